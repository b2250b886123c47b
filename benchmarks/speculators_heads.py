"""EAGLE-3 heads and DFlash / DSpark / DFlash2 drafters written by vllm-project/speculators' own code, read by
``drafts.eagle`` and ``drafts.dflash``: their draft laws against speculators' own forward, option by option.

speculators (the library that trains the EAGLE-3 heads vLLM serves) is downloaded from the package index as published
(``specresearch.paths.pypi_wheel``, nothing installed into the project's environment) with the small packages its
model code imports (loguru, pydantic-settings, python-dotenv); its training-only imports (openai, datasets,
hs_connectors, aiohttp: its package ``__init__`` imports the trainer's data modules) are empty modules where missing,
which its model code never calls. For each configuration below, speculators' ``Eagle3DraftModel`` is built over a
tiny random Llama target (8 layers, hidden 32, 64 tokens), its weights drawn at random (seeded), and saved with its
own ``save_pretrained``; ``drafts.registry.draft_from_name`` reads the directory. speculators' ``forward`` (its
training-time test, ``ttt_steps`` = 3, teacher-forced, eager attention) gives, at every slot j of a 12-token prompt,
the draft logits of step 0 (token x_{j+1} with the target's features of slot j) and of steps 1 and 2 (a drafted slot
reading the head's own previous output, with the next prompt token); ours gives the same numbers as the engine
drafts them: prefill of the prompt's first j + 2 tokens, then one ``score`` per drafted token. The record holds the
largest difference of the draft log-probabilities (draft vocabulary mapped to the target's by ``d2t``) per step,
and, as a control that the comparison can fail, the difference when our reader drops the configuration's option.

DFlash and DSpark (``DFLASH_CASES``): speculators' ``DFlashDraftModel`` / ``DSparkDraftModel`` (a Qwen3 layer over
the target's hidden states ``aux_hidden_state_layer_ids``, blocks of 4; DSpark's Markov head of rank 8, vanilla or
gated, and its confidence head) with random weights, its embedding and (full vocabulary) head the target's, as its
``load_verifier_weights`` makes them; its training forward (one block per anchor, every valid prompt position an
anchor, eager attention: DFlash's ``_backbone_forward``; DSpark's whole ``forward``, whose Markov bias reads each
block's previous tokens, the logits caught where it hands them to its loss) gives each anchor's block logits; ours:
prefill of the prompt before the anchor, the anchor scored as the engine's pending token, then the prompt's next
tokens scored as drafted tokens, against the block positions that predict them (1 to 3; 0 to 3 with
``sample_from_anchor``), for every block inside the prompt. The control drops the Markov head (DSpark), else ``d2t``
(reads draft id i as target id i): the total variation distance of the two laws.

DFlash2 (the ``dflash2`` cases: speculators' ``DFlash2DraftModel``, full vocabulary as it requires, its grouped
convolutions of 2 or 3 taps and its candidate selector of rank 8 over the top 8 or all 64 tokens): its whole training
``forward``, the candidates' scores caught where it hands them to its loss. Its loss puts the verifier's token in the
K-th place where the unary top K lacks it, so our logits at its candidate ids are compared with its scores on the
other K - 1 there and on all K elsewhere, and our log-probabilities with the softmax of its scores where its
candidates are the unary top K the drafter serves (``positions_with_serving_set``). The control zeroes the selector's
predecessor codebook: the largest score difference.

    PYTHONPATH=. .venv/bin/python benchmarks/speculators_heads.py --out benchmarks/records/speculators_heads.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

from specresearch.paths import empty_modules, pypi_wheel

PACKAGES = ("speculators==0.9.0", "loguru==0.7.3", "pydantic-settings==2.16.3", "python-dotenv==1.2.4")
TRAINING_ONLY = ("openai", "datasets", "hs_connectors", "aiohttp")
HIDDEN, HEADS, KV, INTER, VOCAB, DRAFT_VOCAB, LAYERS = 32, 4, 2, 48, 64, 40, 8
PROMPT = [5, 9, 3, 17, 22, 8, 41, 60, 2, 33, 12, 50]
# name -> (Eagle3SpeculatorConfig options, layer config options, the option the control drops)
CASES = {
    "llama": ({}, {}, None),
    "norm_before_residual": ({"norm_before_residual": True}, {}, "norm_before_residual"),
    "norm_before_fc": ({"norm_before_fc": True}, {}, "norm_before_fc"),
    "fc_norm": ({"fc_norm": True}, {}, "fc_norm"),
    "norm_output": ({"norm_output": True}, {}, "norm_output"),
    "eagle3.1": ({"fc_norm": True, "norm_output": True, "norm_before_residual": True}, {}, "norm_output"),
    "two_layers": ({"norm_before_residual": True}, {"num_hidden_layers": 2}, None),
    "qwen3": ({"norm_before_residual": True}, {"model_type": "qwen3"}, None),
    "llama3_rope": ({}, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8}}, None),
    "full_vocabulary": ({"draft_vocab_size": VOCAB}, {}, None),
    "four_features": ({"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 7], "fc_norm": True}, {}, "fc_norm"),
}


def _randomised(model, seed: int):
    """``model``'s parameters drawn at random from ``seed`` (norms near 1, the rest scaled by their fan-in) and, with a
    draft vocabulary, ``d2t`` / ``t2d`` a random subset of the tokens."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=g)
            parameter.copy_(1 + 0.2 * noise if "norm" in parameter_name else noise / parameter.shape[-1] ** 0.5)
        if model.d2t is not None:
            ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
            model.d2t.copy_(ids - torch.arange(DRAFT_VOCAB))
            model.t2d.zero_().index_fill_(0, ids, True)
    return model


def speculators_head(name: str, directory: Path, seed: int):
    """speculators' ``Eagle3DraftModel`` for case ``name``, random weights from ``seed``, saved to ``directory``."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    options, layer_options, _ = CASES[name]
    layer_options = {"model_type": "llama", **layer_options}
    kind = layer_options.pop("model_type")
    layer = AutoConfig.for_model(kind, **{**dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                                 num_key_value_heads=KV, head_dim=HIDDEN // HEADS, num_hidden_layers=1,
                                                 vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6),
                                          **layer_options})
    layer._attn_implementation = "eager"  # the same mask as its flex attention, without compiling on the CPU
    verifier = VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])
    config = Eagle3SpeculatorConfig(transformer_layer_config=layer, **{"draft_vocab_size": DRAFT_VOCAB, **options},
                                    speculators_config=SpeculatorsConfig(
                                        algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
                                        default_proposal_method="greedy", verifier=verifier))
    torch.manual_seed(seed)
    model = _randomised(Eagle3DraftModel(config).eval(), seed)
    model.save_pretrained(directory)
    return model


def their_logits(model, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """speculators' forward over the prompt (slot j: token x_{j+1}, the target's features of slot j): the draft
    vocabulary's log-probabilities of each training-time-test step, ``[n - 1, D]``, captured at its ``lm_head``."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output[0].detach()))
    ids = torch.tensor([PROMPT[1:]])
    with torch.no_grad():
        model(hidden_states=features[:, :-1], input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    hook.remove()
    return [c.float().log_softmax(-1) for c in captured]


def our_logits(target, directory: Path, steps: int) -> list[torch.Tensor]:
    """The same numbers from ``drafts.eagle`` as the engine drafts: at slot j, prefill of the first j + 2 prompt tokens,
    then one ``score`` per drafted token (the next prompt tokens, 0 past the prompt, as speculators pads)."""
    from specresearch.drafts.registry import draft_from_name

    out = [[] for _ in range(steps)]
    for j in range(len(PROMPT) - 1):
        draft = draft_from_name(str(directory), target)
        ids = torch.tensor([PROMPT[: j + 2]])
        _, features = target.prefill(ids, torch.ones_like(ids), hidden_layers=draft.feature_layers)
        draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1))
        logits = [draft.prefill(ids, torch.ones_like(ids))[0]]
        for s in range(1, steps):
            token = PROMPT[j + 1 + s] if j + 1 + s < len(PROMPT) else 0
            logits.append(draft.score(torch.tensor([[token]]))[0, 0])
        for s, row in enumerate(logits):
            out[s].append(row.float().log_softmax(-1))
    return [torch.stack(rows) for rows in out]


def compare(name: str, seed: int, steps: int = 3) -> dict:
    from specresearch.models.toy import tiny_llama

    target = tiny_llama(VOCAB, seed=0, init_std=0.5, num_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER)
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder) / name
        model = speculators_head(name, directory, seed)
        _, features = target.prefill(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.long),
                                     hidden_layers=tuple(_feature_layers(directory)))
        theirs = their_logits(model, features, steps)
        ours = our_logits(target, directory, steps)
        ids = (torch.arange(model.draft_vocab_size) + model.d2t) if model.d2t is not None else torch.arange(VOCAB)
        row = {"case": name, "kind": "eagle3", "seed": seed, "options": CASES[name][0], "layer": CASES[name][1],
               "max_abs_logprob_difference": [float((o[:, ids] - t).abs().max()) for o, t in zip(ours, theirs)],
               "off_support_mass": [float(o.exp().sum(-1).sub(o[:, ids].exp().sum(-1)).abs().max()) for o in ours]}
        dropped = CASES[name][2]
        if dropped is not None:  # the control: our reader without the option, against speculators' numbers
            config = json.loads((directory / "config.json").read_text())
            config[dropped] = False
            (directory / "config.json").write_text(json.dumps(config))
            prefix = {"fc_norm": "fc_norm.", "norm_before_fc": "input_norm."}.get(dropped)
            if prefix:  # and the option's tensors
                from safetensors.torch import load_file, save_file

                tensors = load_file(directory / "model.safetensors")
                save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, directory / "model.safetensors")
            off = our_logits(target, directory, steps)
            row["control_dropped"] = dropped
            row["control_max_abs_logprob_difference"] = [float((o[:, ids] - t).abs().max()) for o, t in zip(off, theirs)]
    return row


# name -> (speculators algorithm, its config options, layer config options); DSpark's Markov heads of rank 8
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 8}
DFLASH_CASES = {
    "dflash": ("dflash", {}, {}),
    "dflash_full_vocabulary": ("dflash", {"draft_vocab_size": VOCAB}, {}),
    "dflash_two_layers_three_features": ("dflash", {"aux_hidden_state_layer_ids": [1, 4, 7]}, {"num_hidden_layers": 2}),
    "dflash_sample_from_anchor": ("dflash", {"sample_from_anchor": True}, {}),
    "dspark": ("dspark", {"markov_rank": 8}, {}),
    "dspark_gated": ("dspark", {"markov_rank": 8, "markov_head_type": "gated"}, {}),
    "dspark_bonus_anchor": ("dspark", {"markov_rank": 8, "sample_from_anchor": False}, {}),
    "dspark_full_vocabulary_two_layers": ("dspark", {"markov_rank": 8, "draft_vocab_size": VOCAB},
                                          {"num_hidden_layers": 2}),
    "dspark_without_markov_head": ("dspark", {"markov_rank": 0, "enable_confidence_head": False}, {}),
    "dflash2": ("dflash2", {**DFLASH2, "draft_vocab_size": VOCAB}, {}),
    "dflash2_three_taps_sample_from_anchor": ("dflash2", {**DFLASH2, "draft_vocab_size": VOCAB, "conv_kernel_size": 3,
                                                          "conv_group_size": 4, "sample_from_anchor": True}, {}),
    "dflash2_two_layers_every_token": ("dflash2", {**DFLASH2, "draft_vocab_size": VOCAB, "selector_top_k": VOCAB},
                                       {"num_hidden_layers": 2}),
    "xpress": ("xpress", {"xpress_rank": 8}, {}),
    "xpress_full_vocabulary_sample_from_anchor": ("xpress", {"xpress_rank": 8, "draft_vocab_size": VOCAB,
                                                             "sample_from_anchor": True}, {}),
    "xpress_two_layers_mlp_ratio_4": ("xpress", {"xpress_rank": 8, "xpress_mlp_ratio": 4}, {"num_hidden_layers": 2}),
}
DFLASH_BLOCK = 4


def _their_block_logits(model, algorithm: str, features, prompt, last_hidden):
    """speculators' drafter on ``prompt``: the logits of every anchor's block ``[anchors, B, draft vocabulary]`` and
    each block's anchor. DFlash: its ``_backbone_forward``; DSpark: its whole training ``forward`` (the Markov bias
    of each block's previous tokens added there), the logits caught where it hands them to its loss; DFlash2: its
    whole ``forward``, the candidates' scores ``[anchors, B, K]`` caught there, with their ids and whether the
    verifier's token was among the unary top K (else its loss put it in the K-th place)."""
    import speculators.models.dflash2.core as dflash2_core
    import speculators.models.dspark.core as dspark_core
    import speculators.models.xpress.core as xpress_core

    caught = {}
    backbone = model._backbone_forward

    def backbone_caught(*args, **kwargs):
        caught["backbone"] = backbone(*args, **kwargs)
        return caught["backbone"]

    def metrics_caught(logits, *args, **kwargs):
        caught["logits"] = logits
        return torch.zeros(()), {}

    def selector_caught(**kwargs):
        caught["logits"] = kwargs["candidate_logits"]
        caught["candidates"] = (kwargs["training_candidate_ids"], kwargs["contains_target"])
        return torch.zeros(()), {}

    model._backbone_forward = backbone_caught
    metrics = (dspark_core.compute_metrics, dflash2_core.compute_metrics, xpress_core.compute_metrics)
    dspark_core.compute_metrics, dflash2_core.compute_metrics, xpress_core.compute_metrics = (
        metrics_caught, selector_caught, metrics_caught)
    try:
        with torch.no_grad():
            arguments = (features, prompt, torch.ones_like(prompt), last_hidden, torch.zeros_like(prompt))
            if algorithm in ("dspark", "dflash2", "xpress"):
                model(*arguments, max_anchors=len(PROMPT))
            else:
                backbone_caught(*arguments, max_anchors=len(PROMPT))
                caught["logits"] = caught["backbone"][1]
    finally:
        dspark_core.compute_metrics, dflash2_core.compute_metrics, xpress_core.compute_metrics = metrics
        del model._backbone_forward
    blocks = caught["backbone"][4].view(-1, DFLASH_BLOCK)
    logits = caught["logits"][0].float().view(len(blocks), DFLASH_BLOCK, -1)
    if algorithm == "dflash2":
        ids, contains = caught["candidates"]
        logits = (logits, ids[0].view(logits.shape), contains[0].view(logits.shape[:2]))
    return logits, blocks[:, 0].tolist()


def _our_predictions(target, directory: Path, prompt, anchor: int, count: int, *, raw: bool = False) -> torch.Tensor:
    """Ours as the engine drafts: prefill of the prompt before ``anchor``, the anchor scored as the pending token,
    then the prompt's next ``count - 1`` tokens as drafted tokens -> ``[count, V]`` log-probabilities (``raw``:
    the logits)."""
    from specresearch.drafts.registry import draft_from_name

    draft = draft_from_name(str(directory), target)
    before = prompt[:, :anchor]
    _, features = target.prefill(before, torch.ones_like(before), hidden_layers=draft.feature_layers)
    shifted = torch.cat([torch.zeros_like(features[:, :1]), features], 1)
    draft.observe(shifted[:, :-1])
    draft.prefill(before, torch.ones_like(before))
    draft.observe(shifted[:, -1:])
    rows = [draft.score(prompt[:, anchor + j : anchor + j + 1])[0, -1] for j in range(count)]
    logits = torch.stack(rows).float()
    return logits if raw else logits.log_softmax(-1)


def dflash_compare(name: str, seed: int) -> dict:
    """speculators' DFlash or DSpark drafter for case ``name`` against ``drafts.dflash`` (module docstring)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.models.xpress.config import XPressSpeculatorConfig
    from speculators.models.xpress.core import XPressDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    from specresearch.models.toy import tiny_llama

    target = tiny_llama(VOCAB, seed=0, init_std=0.5, num_layers=LAYERS, hidden_size=HIDDEN)
    algorithm, options, layer_options = DFLASH_CASES[name]
    layer = AutoConfig.for_model("qwen3", **{**dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                                    num_key_value_heads=KV, head_dim=HIDDEN // HEADS, num_hidden_layers=1,
                                                    vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6),
                                             **layer_options})
    layer._attn_implementation = "eager"
    verifier = VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])
    config_class, model_class = {"dspark": (DSparkSpeculatorConfig, DSparkDraftModel), "dflash": (
        DFlashSpeculatorConfig, DFlashDraftModel), "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
        "xpress": (XPressSpeculatorConfig, XPressDraftModel)}[algorithm]
    config = config_class(
        transformer_layer_config=layer, **{"draft_vocab_size": DRAFT_VOCAB, "block_size": DFLASH_BLOCK,
                                           "aux_hidden_state_layer_ids": [2, 5], "mask_token_id": VOCAB - 1, **options},
        speculators_config=SpeculatorsConfig(algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig()],
                                             default_proposal_method="greedy", verifier=verifier))
    torch.manual_seed(seed)
    model = _randomised(model_class(config).eval(), seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)  # the verifier's, as loaded
        if model.d2t is None:
            model.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
    ids = (torch.arange(DRAFT_VOCAB) + model.d2t) if model.d2t is not None else torch.arange(VOCAB)
    prompt = torch.tensor([PROMPT])
    first = 0 if config.sample_from_anchor else 1  # the block position of the first drafted token
    count = DFLASH_BLOCK - first
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder) / name
        model.save_pretrained(directory)
        with torch.no_grad():
            hidden = target.model(prompt, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in config.aux_hidden_state_layer_ids], -1)
        theirs, anchors = _their_block_logits(model, algorithm, features, prompt, hidden[-1])
        # the first token has no context (the engine never anchors there); a block must lie inside the prompt
        compared = [(block, a) for block, a in enumerate(anchors) if 1 <= a and a + count <= len(PROMPT)]
        row = {"case": name, "kind": algorithm, "seed": seed, "options": options, "layer": layer_options,
               "anchors": len(compared), "drafted_per_anchor": count}
        if algorithm == "dflash2":
            return row | _dflash2_compare(target, directory, prompt, theirs, compared, first, count)
        theirs = theirs.log_softmax(-1)
        control = "markov_head" if getattr(model, "markov_head", None) is not None else (
            "refiner_head.mix_l" if algorithm == "xpress" else "d2t" if model.d2t is not None else None)
        differences, distances = [], []
        for dropped in (False, True):
            if dropped:  # the control: the Markov head dropped (DSpark), XPress's mixer zeroed, else d2t (id i as i)
                if control is None:
                    break
                _drop(directory, control)
            worst = 0.0
            for block, anchor in compared:
                ours = _our_predictions(target, directory, prompt, anchor, count)  # [count, V]
                want = theirs[block, first:]
                if dropped:  # total variation from speculators' law
                    law = torch.zeros_like(ours).index_copy_(1, ids, want.exp())
                    worst = max(worst, float((ours.exp() - law).abs().sum(-1).max() / 2))
                else:
                    worst = max(worst, float((ours[:, ids] - want).abs().max()))
            (distances if dropped else differences).append(worst)
    row["max_abs_logprob_difference"] = differences
    if distances:
        row |= {"control_dropped": control, "control_total_variation": distances}
    return row


def _dflash2_compare(target, directory: Path, prompt, theirs, compared, first: int, count: int) -> dict:
    """A DFlash2 drafter's candidates: our logits at speculators' candidate ids against its scores (where its loss put
    the verifier's token in the K-th place, the other K - 1), our log-probabilities against the softmax of its scores
    where its candidates are the unary top K the drafter serves; the control zeroes the selector's predecessor
    codebook (the scores are then the head's logits)."""
    scores, candidates, contains = theirs
    found = {"max_abs_logprob_difference": [0.0], "max_abs_score_difference": [0.0], "control_dropped":
             "candidate_selector", "control_max_abs_score_difference": [0.0], "positions_with_serving_set": 0}
    for dropped in (False, True):
        if dropped:
            _drop(directory, "candidate_selector")
        for block, anchor in compared:
            ours = _our_predictions(target, directory, prompt, anchor, count, raw=True)  # [count, V]
            want, ids, full = scores[block, first:], candidates[block, first:], contains[block, first:]
            got = ours.gather(-1, ids)
            kept = torch.ones_like(ids, dtype=torch.bool)
            kept[~full, -1] = False
            key = "control_max_abs_score_difference" if dropped else "max_abs_score_difference"
            found[key][0] = max(found[key][0], float((got - want)[kept].abs().max()))
            if not dropped and full.any():
                difference = (got[full].log_softmax(-1) - want[full].log_softmax(-1)).abs().max()
                found["max_abs_logprob_difference"][0] = max(found["max_abs_logprob_difference"][0], float(difference))
                found["positions_with_serving_set"] += int(full.sum())
    return found


def _drop(directory: Path, what: str) -> None:
    """The saved drafter in ``directory`` without its Markov head (``markov_head``: rank 0 in its config, the tensors
    removed), with ``d2t``, the candidate selector's predecessor codebook or XPress's mixer zeroed."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    zeroed = {"d2t": "d2t", "candidate_selector": "candidate_selector.predecessor_codebook",
              "refiner_head.mix_l": "refiner_head.mix_l"}.get(what)
    if zeroed:
        tensors[zeroed] = torch.zeros_like(tensors[zeroed])
    else:
        config = json.loads((directory / "config.json").read_text())
        config |= {"markov_rank": 0, "enable_confidence_head": False}
        (directory / "config.json").write_text(json.dumps(config))
        tensors = {k: v for k, v in tensors.items() if not k.startswith(("markov_head.", "confidence_head."))}
    save_file(tensors, directory / "model.safetensors")


# name -> (Eagle3SpeculatorConfig options, layer config options); depths K = PEAGLE_DEPTHS, mask token VOCAB - 1
PEAGLE_CASES = {
    "peagle": ({}, {}),
    "peagle_eagle3.1": ({"fc_norm": True, "norm_output": True, "norm_before_residual": True}, {}),
    "peagle_two_layers_full_vocabulary": ({"draft_vocab_size": VOCAB, "norm_before_fc": True}, {"num_hidden_layers": 2}),
}
PEAGLE_DEPTHS = 4


def peagle_compare(name: str, seed: int) -> dict:
    """speculators' ``PEagleDraftModel`` for case ``name`` against ``drafts.peagle``: its whole training ``forward``
    with every slot at depth 0 and, from every anchor whose rollout fits the prompt, depths 1 to K - 1 (its COD
    sampling replaced by that choice, the logits caught where it hands them to its loss); ours as the engine drafts:
    prefill of the prompt up to the anchor's token, then K - 1 drafting calls. The control zeroes ``mask_hidden``:
    the total variation distance of the two laws at depths >= 1."""
    import speculators.models.peagle.core as peagle_core
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    from specresearch.drafts.registry import draft_from_name
    from specresearch.models.toy import tiny_llama

    options, layer_options = PEAGLE_CASES[name]
    target = tiny_llama(VOCAB, seed=0, init_std=0.5, num_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=INTER)
    layer = AutoConfig.for_model("llama", **{**dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                                                    num_key_value_heads=KV, head_dim=HIDDEN // HEADS, num_hidden_layers=1,
                                                    vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6),
                                             **layer_options})
    layer._attn_implementation = "eager"
    verifier = VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer, mask_token_id=VOCAB - 1, **{"draft_vocab_size": DRAFT_VOCAB, **options},
        speculators_config=SpeculatorsConfig(algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(
            speculative_tokens=PEAGLE_DEPTHS)], default_proposal_method="greedy", verifier=verifier))
    torch.manual_seed(seed)
    model = _randomised(peagle_core.PEagleDraftModel(config).eval(), seed)
    slots = len(PROMPT) - 1  # after speculators' shift: slot j holds x_{j+1} with the features of slot j
    anchors = [j for j in range(slots) if j + PEAGLE_DEPTHS - 1 < slots]
    anchor_pos = torch.tensor(list(range(slots)) + [j for j in anchors for _ in range(1, PEAGLE_DEPTHS)])
    depth = torch.tensor([0] * slots + [d for _ in anchors for d in range(1, PEAGLE_DEPTHS)])
    caught = {}

    def metrics_caught(logits, *args, **kwargs):
        caught["logits"] = logits[0].float().log_softmax(-1)
        return torch.zeros(()), {}

    prompt = torch.tensor([PROMPT])
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder) / name
        model.save_pretrained(directory)
        _, features = target.prefill(prompt, torch.ones_like(prompt), hidden_layers=tuple(_feature_layers(directory)))
        saved = peagle_core.generate_cod_sample_indices, peagle_core.compute_metrics
        peagle_core.generate_cod_sample_indices = lambda *args, **kwargs: (anchor_pos, depth)
        peagle_core.compute_metrics = metrics_caught
        try:
            with torch.no_grad():
                ids = prompt[:, 1:]
                model(hidden_states=features[:, :-1], input_ids=ids, document_ids=torch.zeros_like(ids),
                      verifier_last_hidden_states=torch.zeros(1, slots, HIDDEN), num_depths=PEAGLE_DEPTHS)
        finally:
            peagle_core.generate_cod_sample_indices, peagle_core.compute_metrics = saved
        theirs = caught["logits"]  # [slots + anchors (K - 1), D]
        token_ids = (torch.arange(model.draft_vocab_size) + model.d2t) if model.d2t is not None else torch.arange(VOCAB)
        row = {"case": name, "kind": "peagle", "seed": seed, "options": options, "layer": layer_options,
               "depths": PEAGLE_DEPTHS, "anchors": len(anchors)}
        for dropped in (False, True):
            if dropped:
                from safetensors.torch import load_file, save_file

                tensors = load_file(directory / "model.safetensors")
                save_file(tensors | {"mask_hidden": torch.zeros_like(tensors["mask_hidden"])},
                          directory / "model.safetensors")
            worst = [0.0] * PEAGLE_DEPTHS
            for a, j in enumerate(anchors):
                draft = draft_from_name(str(directory), target)
                before = prompt[:, : j + 2]
                draft.observe(torch.cat([torch.zeros_like(features[:, :1]), features[:, : j + 1]], 1))
                ours = [draft.prefill(before, torch.ones_like(before))[0]]
                ours += [draft.score(prompt[:, j + 1 + d : j + 2 + d])[0, 0] for d in range(1, PEAGLE_DEPTHS)]
                want = [theirs[j]] + [theirs[slots + a * (PEAGLE_DEPTHS - 1) + d - 1] for d in range(1, PEAGLE_DEPTHS)]
                for d, (o, t) in enumerate(zip(ours, want)):
                    o = o.float().log_softmax(-1)
                    if dropped:
                        law = torch.zeros_like(o).index_copy_(0, token_ids, t.exp())
                        gap = float((o.exp() - law).abs().sum() / 2)
                    else:
                        gap = float((o[token_ids] - t).abs().max())
                    worst[d] = max(worst[d], gap)
            row["control_total_variation" if dropped else "max_abs_logprob_difference"] = worst
        row["control_dropped"] = "mask_hidden (zeroed)"
    return row


QWEN_MTP_CASES = ("qwen3_5_text", "qwen3_next")  # a dense Qwen3.5 and a Qwen3-Next with experts (models.families)


def qwen_mtp_compare(model_type: str, seed: int) -> dict:
    """A Qwen3.5 / Qwen3-Next checkpoint with one MTP layer (``models.families.tiny_qwen_mtp_checkpoint``, experts one
    per tensor) read by speculators' ``MTPConverter`` (its own renaming and expert fusion) into its ``MTPDraftModel``,
    whose training forward's first step at every slot (token x_{t+1} with the target's last state of slot t, the one
    vLLM serves) against ``drafts.qwen_mtp`` as the engine drafts (prefill of the prompt up to x_{t+1}), both reading
    the target's states of one prefill of the prompt. Its later steps attend to earlier slots' step outputs (teacher forcing), which drafting never computes:
    not compared. The control swaps the checkpoint's two input norms: the total variation distance of the two laws."""
    from safetensors.torch import load_file, save_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.convert.mtp.converter import MTPConverter
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from specresearch.drafts.registry import draft_from_name
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.families import tiny_qwen_mtp_checkpoint

    prompt = torch.tensor([PROMPT])
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder) / model_type
        tiny_qwen_mtp_checkpoint(directory, model_type, seed=seed)
        target = CausalLM(str(directory), device="cpu", dtype=torch.float32)
        model = target.model
        verifier = VerifierConfig(name_or_path=str(directory), architectures=[type(model).__name__])
        config = MTPSpeculatorConfig(transformer_layer_config=copy.deepcopy(model.config.get_text_config()),
                                     speculators_config=SpeculatorsConfig(
                                         algorithm="mtp", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=1)],
                                         default_proposal_method="greedy", verifier=verifier))
        theirs = MTPDraftModel(config).eval()
        missing, _ = theirs.load_state_dict(MTPConverter().convert_to_state_dict(directory), strict=False)
        with torch.no_grad():
            theirs.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
            theirs.lm_head.weight.copy_(model.get_output_embeddings().weight)
            _, states = target.prefill(prompt, torch.ones_like(prompt), hidden_layers=(model.config.num_hidden_layers,))
            want = theirs(input_ids=prompt, hidden_states=states)[0][0][0].float().log_softmax(-1)  # step 0 [n - 2, V]
        row = {"case": f"mtp_{model_type}", "kind": "qwen_mtp", "seed": seed, "slots": len(want),
               "speculators_missing": sorted(k for k in missing if not k.startswith(("embed_tokens", "lm_head")))}
        for control in (False, True):
            if control:
                tensors = load_file(directory / "model.safetensors")
                a, b = "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"
                tensors[a], tensors[b] = tensors[b], tensors[a]
                save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
            draft, worst = draft_from_name("mtp", target), 0.0
            for t in range(len(want)):  # both read the same target states (the target's own prefill)
                ids = prompt[:, : t + 2]
                draft.observe(torch.cat([torch.zeros_like(states[:, :1]), states[:, : t + 1]], 1))
                ours = draft.prefill(ids, torch.ones_like(ids))[0].float().log_softmax(-1)
                gap = (ours.exp() - want[t].exp()).abs().sum() / 2 if control else (ours - want[t]).abs().max()
                worst = max(worst, float(gap))
            row["control_total_variation" if control else "max_abs_logprob_difference"] = [worst]
        row["control_dropped"] = "the two input norms swapped"
    return row


def _feature_layers(directory: Path) -> list[int]:
    config = json.loads((directory / "config.json").read_text())
    return config.get("eagle_aux_hidden_state_layer_ids") or [2, LAYERS // 2, LAYERS - 3]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/records/speculators_heads.json")
    parser.add_argument("--seeds", type=int, default=2, help="random heads per configuration")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest log-probability difference that agrees")
    parser.add_argument("--only", choices=("eagle3", "dflash", "peagle", "qwen_mtp"), help="one kind (default: all)")
    parser.add_argument("--case", action="append", help="only these cases (names in CASES / DFLASH_CASES / PEAGLE_CASES / "
                        "QWEN_MTP_CASES)")
    args = parser.parse_args(argv)
    for spec in PACKAGES:
        sys.path.insert(0, str(pypi_wheel(spec)))
    empty_modules(TRAINING_ONLY)
    from specresearch.experiments.records import record_header

    rows = []
    cases = [(n, compare) for n in CASES if args.only in (None, "eagle3")] + [
        (n, dflash_compare) for n in DFLASH_CASES if args.only in (None, "dflash")] + [
        (n, peagle_compare) for n in PEAGLE_CASES if args.only in (None, "peagle")] + [
        (n, qwen_mtp_compare) for n in QWEN_MTP_CASES if args.only in (None, "qwen_mtp")]
    cases = [(n, run) for n, run in cases if not args.case or n in args.case]
    for name, run in cases:
        for seed in range(args.seeds):
            row = run(name, seed)
            differences = row["max_abs_logprob_difference"] + row.get("max_abs_score_difference", [])
            row["agrees"] = max(differences) <= args.tolerance
            rows.append(row)
            control = next((row[k] for k in ("control_max_abs_logprob_difference", "control_total_variation",
                                             "control_max_abs_score_difference") if k in row), None)
            print(f"{name:22s} seed {seed}: max |diff| per step {[f'{d:.1e}' for d in row['max_abs_logprob_difference']]}"
                  + (f"; without {row['control_dropped']}: {[f'{d:.2f}' for d in control]}" if control else ""))
    header = record_header("benchmarks/speculators_heads.py", sys.argv[1:] if argv is None else argv, target=None,
                           packages=list(PACKAGES),
                           replaced_by_empty_modules=list(TRAINING_ONLY), tolerance=args.tolerance,
                           target_model=f"tiny random Llama: {LAYERS} layers, hidden {HIDDEN}, {VOCAB} tokens",
                           prompt=PROMPT, dflash_block=DFLASH_BLOCK)
    record = {**header, "all_agree": all(r["agrees"] for r in rows), "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{sum(r['agrees'] for r in rows)} of {len(rows)} heads agree within {args.tolerance}; record {args.out}")
    return 0 if record["all_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
