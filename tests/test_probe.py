"""The probe of families the matrices do not check (``models.probe``): those whose cache scores a draft tree otherwise
than uncached forwards are refused in one line, those that score alike are taken, and the matrices' families are not
probed. Tiny random-weight models of transformers' own classes, on the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import tree_path, visible_from_parents

from specresearch.models.causal_lm import CausalLM
from specresearch.models.families import FAMILIES, MORE_FAMILIES
from specresearch.models.positions import CACHE_COUNTED, ROBERTA_KIN
from specresearch.models.probe import CHECKED_TYPES, check_cached_tree, logit_gap, static_form_calls
from specresearch.models.static_lm import GRAPH_BREAKS, HOST_READS

SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=256, initializer_range=0.5)


def tiny(name: str, **settings):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, name)(**{**SIZES, **settings})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


WRONG = {  # family: (config class, its settings)
    "moshi": ("MoshiConfig", dict(num_key_value_heads=4, sliding_window=6, audio_vocab_size=16, num_codebooks=2)),
}


@pytest.mark.parametrize("family", WRONG)
def test_a_family_whose_cache_scores_otherwise_is_refused_and_wrong_unprobed(family):
    """Moshi windows its attention over slots beside the masks (its uncached forward attends to every token): it is
    refused in one line naming the call that differs most; with ``probe=False`` the same model is taken and its cached
    tree logits differ from an uncached forward of each path (the probe's negative control)."""
    name, settings = WRONG[family]
    with pytest.raises(ValueError, match="scores (the prompt|a tree's .*|a token after dead slots) otherwise than an "
                       "uncached forward") as refused:
        CausalLM(tiny(name, **settings), device="cpu")
    assert "\n" not in str(refused.value) and f"({tiny(name, **settings).config.model_type})" in str(refused.value)
    lm, reference = CausalLM(tiny(name, **settings), device="cpu", probe=False), tiny(name, **settings)
    prompt = [(5 + 7 * i) % 128 for i in range(9)]
    lm.prefill(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long))
    parents, tokens = [-1, 0, 0, 2], torch.tensor([[10, 20, 30, 40]])
    lm.begin_tree()
    logits = lm.score_tree(tokens, torch.tensor([[0, 1, 1, 2]]), visible_from_parents(parents))
    with torch.no_grad():
        worst = max((logits[0, i] - reference(input_ids=torch.tensor([prompt + tree_path(tokens[0], parents, i)]))
                     .logits[0, -1]).abs().max().item() for i in range(4))
    assert worst > 1e-2, (family, worst)


DECODER_SIZES = dict(decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, d_model=32)


def gap(lm, reference) -> float:
    """The largest logit gap of ``lm`` (a ``CausalLM``) against ``reference``'s uncached forwards: a cached tree after
    two prompts (one left-padded), then a chain after the kept path, whose dropped node leaves the path's last two
    nodes a slot past their positions."""
    def forward(tokens):
        with torch.no_grad():
            return reference(input_ids=torch.tensor([tokens])).logits[0, -1]

    prompts, mask = torch.tensor([[5, 9, 2, 33, 7], [1, 1, 4, 8, 11]]), torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    lm.prefill(prompts, mask)
    parents, tokens = [-1, 0, 0, 2], torch.tensor([[10, 20, 30, 40]] * 2)
    lm.begin_tree()
    logits = lm.score_tree(tokens, torch.tensor([[0, 1, 1, 2]] * 2), visible_from_parents(parents).expand(2, -1, -1))
    histories = [[5, 9, 2, 33, 7], [4, 8, 11]]
    worst = max(logit_gap(logits[b, i], forward(histories[b] + tree_path(tokens[b], parents, i)))
                for b in range(2) for i in range(4))
    lm.end_tree(torch.tensor([[True, False, True, True]] * 2))  # b dropped: c and d sit a slot past their positions
    logits = lm.score(torch.tensor([[50, 51]] * 2))
    return max(worst, *(logit_gap(logits[b, i], forward(histories[b] + [10, 30, 40, 50, 51][:4 + i]))
                        for b in range(2) for i in range(2)))


@pytest.mark.parametrize("kind", ROBERTA_KIN + CACHE_COUNTED + ("roformer",))
def test_absolute_positions_numbered_otherwise_are_taken_from_the_masks(kind, monkeypatch):
    """RoBERTa's embeddings as a decoder's (CamemBERT's, XLM-R's, XLM-R-XL's, Data2Vec-Text's, RoBERTa-PreLN's) number
    a row's tokens from the padding id + 1; the decoders of BART's kin (mBART, MVP, PLBart, Blenderbot,
    Blenderbot-Small, BigBird-Pegasus, Marian, Pegasus, TrOCR) embed the cache's slot count plus the token's index, and
    RoFormer's rotates by it. ``positions_from_masks`` hands them positions (RoBERTa: the wrapper's position ids
    offset; BART's kin and RoFormer: read off the masks), and the model is probed and taken: a cached tree after two prompts (one left-padded), then a chain
    after the kept path, equal an uncached forward of each history. Unmended (the control), the same calls differ."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import specresearch.models.causal_lm as causal_lm
    import specresearch.models.positions as positions

    def model():
        config = AutoConfig.for_model(kind, **{**SIZES, **DECODER_SIZES, "is_decoder": True, "pad_token_id": 1})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()

    assert gap(CausalLM(model(), device="cpu"), model()) < 1e-4
    monkeypatch.setattr(positions, "slot_placement", lambda model, config: None)
    monkeypatch.setattr(causal_lm, "positions_from_masks", lambda model: False)
    assert gap(CausalLM(model(), device="cpu", probe=False), model()) > 1e-2


def test_a_family_that_fails_inside_transformers_on_a_tree_is_refused_in_one_line():
    """ProphetNet's decoder takes a cache for one token at a time: its assertion becomes a one-line refusal."""
    from transformers import ProphetNetConfig, ProphetNetForCausalLM

    config = ProphetNetConfig(vocab_size=128, hidden_size=32, num_encoder_layers=1, num_decoder_layers=1,
                              num_encoder_attention_heads=4, num_decoder_attention_heads=4, decoder_ffn_dim=64,
                              encoder_ffn_dim=64, max_position_embeddings=256, is_decoder=True)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="fails CausalLM's probe of a cached draft tree .AssertionError") as refused:
        CausalLM(ProphetNetForCausalLM(config).eval(), device="cpu")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name, settings", [("OlmoConfig", {}), ("Qwen2MoeConfig", dict(num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=16))])
def test_an_unchecked_family_that_scores_alike_is_taken_and_left_fresh(name, settings, monkeypatch):
    """OLMo and Qwen2-MoE (a window in its config that it does not use) are not in the matrices: probed, taken, and
    the wrapper starts a batch as a fresh one does (the same greedy continuation as an unprobed wrapper)."""
    import specresearch.models.causal_lm as causal_lm
    from specresearch.config import SamplingConfig
    from specresearch.engine.generate import autoregressive_generate

    model = tiny(name, **settings)
    assert model.config.model_type not in CHECKED_TYPES
    probed = []
    monkeypatch.setattr(causal_lm, "check_cached_tree", lambda lm: probed.append(check_cached_tree(lm)))
    lm = CausalLM(model, device="cpu")
    assert len(probed) == 1 and lm.cache_length == 0
    greedy = dict(max_new_tokens=8, sampling=SamplingConfig(temperature=0.0))
    assert (autoregressive_generate(lm, [[5, 9, 2]], **greedy).tokens
            == autoregressive_generate(CausalLM(tiny(name, **settings), device="cpu", probe=False), [[5, 9, 2]],
                                       **greedy).tokens)


def test_the_matrices_families_are_not_probed(monkeypatch):
    """Every family of ``models.families`` is checked by the matrices, so never probed (the embedded target's Llama
    included); ``probe=True`` probes one anyway."""
    import transformers

    import specresearch.models.causal_lm as causal_lm
    from specresearch.models.families import tiny_family_model

    assert {getattr(transformers, name).model_type for name, _, _ in (*FAMILIES.values(), *MORE_FAMILIES.values())} \
        == CHECKED_TYPES
    probed = []
    monkeypatch.setattr(causal_lm, "check_cached_tree", probed.append)
    CausalLM(tiny_family_model("llama"), device="cpu")
    assert not probed
    CausalLM(tiny_family_model("llama"), device="cpu", probe=True)
    assert len(probed) == 1


def test_the_sweeps_record_takes_no_type_whose_cache_scores_otherwise():
    """``benchmarks/family_sweep.py``'s record: of every causal-LM type transformers builds tiny, on eager attention and
    on sdpa, none whose cached tree differs from uncached forwards (or fails) is taken, the probe refuses none that
    scores alike unless the wrapper refuses its layers anyway (no false refusal), every taken type's static form
    (the captured steps' cache) scores alike or is refused, and its captured step traces as one graph unless the
    captured modes refuse its family."""
    import json
    from pathlib import Path

    record = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "family_sweep.json")
                        .read_text())
    built = [row for row in record["rows"] if row["built"]]
    on_sdpa = [row["sdpa"] for row in built if row["sdpa"]["built"]]
    assert len(record["rows"]) >= 190 and len(built) >= 180 and len(on_sdpa) >= 150
    for kernel, columns in (("eager", built), ("sdpa", on_sdpa)):
        assert not [column for column in columns if column["unprobed"] != "exact" and column["wrapper"] == "taken"]
        assert not [column for column in columns if column["unprobed"] == "exact" and "probe" in column["wrapper_detail"]]
        taken = [column for column in columns if column["wrapper"] == "taken"]
        assert taken and all(column["static"] in ("exact", "refused") for column in taken), kernel
        assert sum(column["static"] == "exact" for column in taken) >= 0.8 * len(taken), kernel
    for summary in (record["summary"], record["summary"]["sdpa"]):
        assert summary["taken but not exact"] == 0 and summary["static taken but not exact"] == 0
    # a captured step traced as one graph, but for the types the captured modes refuse (models.static_lm), and those
    # only: no family is captured that cannot be, none refused that can
    captured = {(row["model_type"], kernel): column["captured"] for row in built
                for kernel, column in (("eager", row), ("sdpa", row["sdpa"])) if column.get("static") == "exact"}
    assert len(captured) >= 200 and set(captured.values()) <= {"one graph", "breaks", "fails"}
    apart = {kind for (kind, _), status in captured.items() if status != "one graph"}
    assert apart == set(HOST_READS) | set(GRAPH_BREAKS), apart


MULTIMODAL_TEXT = dict(SIZES, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
MULTIMODAL = {  # the multimodal configs whose AutoModelForCausalLM is the multimodal wrapper (...ForConditionalGeneration)
    "gemma3": ("Gemma3Config", dict(text_config=MULTIMODAL_TEXT, mm_tokens_per_image=4,
                                    vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=64, image_size=28, patch_size=14))),
    "gemma4": ("Gemma4Config", dict(text_config=dict(MULTIMODAL_TEXT, global_head_dim=8, hidden_size_per_layer_input=0,
                                                     vocab_size_per_layer_input=0))),
}


@pytest.mark.parametrize("kind", MULTIMODAL)
@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_a_multimodal_wrapper_scores_text_as_its_uncached_forward_on_both_caches(kind, kernel):
    """Gemma 3's and Gemma 4's checkpoints load as their multimodal wrappers (``Gemma3ForConditionalGeneration``, the
    language model inside it): the wrapper takes them, and a cached tree and chain (windows of 6 passed) and the static
    form's chain, tree, kept path and token after give the logits of uncached forwards of the same text."""
    import transformers
    from transformers import AutoModelForCausalLM

    name, settings = MULTIMODAL[kind]

    def model():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(getattr(transformers, name)(**settings), attn_implementation=kernel,
                                                dtype=torch.float32).eval()

    reference = model()
    assert type(reference).__name__.endswith("ForConditionalGeneration")
    assert gap(CausalLM(model(), device="cpu"), reference) < 1e-4

    with torch.no_grad():
        worst = max(logit_gap(logits, reference(input_ids=torch.tensor([sequence])).logits[0, -1])
                    for logits, sequence in static_form_calls(CausalLM(model(), device="cpu").static_form()))
    assert worst < 1e-4


def test_an_error_without_a_message_is_named_by_where_it_was_raised():
    """A model's bare ``assert`` (XLM's mask check) reaches the probe's refusal with no text: ``error_line`` names the
    file, line and code that raised it instead, and keeps a message where there is one."""
    from specresearch.models.probe import error_line

    def bare():  # as an ``assert`` raises outside pytest's rewriting of this file
        raise AssertionError

    try:
        bare()
    except AssertionError as error:
        line = error_line(error)
    assert line.startswith("AssertionError: raised at tests/test_probe.py:") and line.endswith(": raise AssertionError")
    assert error_line(ValueError("two\n  lines"), limit=9) == "ValueError: two lines"[:9]


def test_git_gets_four_d_masks_since_it_widens_a_two_d_one_by_image_tokens(monkeypatch):
    """GIT widens a 2-D padding mask after a cached call by the image's patch tokens it assumes cached, which a
    text-only call has none of: the wrapper hands it 4-D masks only (``attention.WIDENS_2D``), the probe takes it, and
    a chain after uneven rollbacks equals an uncached forward. Handed 2-D masks (the control), the probe refuses it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import specresearch.models.attention as attention

    def model():
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                      patch_size=16)
        config = AutoConfig.for_model("git", **{**SIZES, "vision_config": vision})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()

    lm, reference = CausalLM(model(), device="cpu"), model()
    assert lm._attention.four_d
    lm.prefill(torch.tensor([[5, 9, 2, 33, 7], [0, 0, 4, 8, 11]]), torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]))
    lm.score(torch.tensor([[20, 21, 22]] * 2))
    lm.rollback([1, 2])
    logits = lm.score(torch.tensor([[30, 31]] * 2))
    histories = [[5, 9, 2, 33, 7, 20, 21], [4, 8, 11, 20]]
    with torch.no_grad():
        worst = max(logit_gap(logits[b, i], reference(input_ids=torch.tensor([histories[b] + [30, 31][:i + 1]]))
                              .logits[0, -1]) for b in range(2) for i in range(2))
    assert worst < 1e-4
    monkeypatch.setattr(attention, "WIDENS_2D", ())
    with pytest.raises(ValueError, match="otherwise than an uncached forward"):
        CausalLM(model(), device="cpu")
