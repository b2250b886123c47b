"""The package's front door: a small documented API, loaded on first use, and ``generate`` as the CLI does it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import specresearch
from specresearch.models.toy import ToyLM


def test_the_front_door_lists_its_api_and_loads_no_torch_until_asked():
    assert {"generate", "load_pair", "speculative_generate", "block_verify", "exact", "audit", "SamplingConfig"} <= set(specresearch.__all__)
    assert set(specresearch.__all__) <= set(dir(specresearch))
    code = "import sys, specresearch; print('torch' in sys.modules); specresearch.block_verify; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
    assert specresearch.audit.audit is not None and specresearch.exact.two_symbol_example() is not None


def test_generate_takes_a_pair_and_token_ids():
    target = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    draft = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
    out = specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, gamma=2, max_new_tokens=10, seed=3)
    want = specresearch.speculative_generate(target, draft, [[1, 2, 3]], gamma=2, max_new_tokens=10, seed=3)
    assert out.tokens == want.tokens and len(out.tokens[0]) == 10


def test_generate_builds_a_named_draft_for_the_given_target():
    target = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    out = specresearch.generate([[1, 2, 1, 2]], target=target, draft="ngram", chat=False, gamma=2, max_new_tokens=6)
    assert len(out.tokens[0]) == 6



def test_generate_takes_a_transformers_model_or_a_checkpoint_directory(tmp_path):
    """A transformers causal LM (target or draft) is wrapped in ``CausalLM``, a directory loaded with its tokenizer:
    the tokens of the same pair driven through the engine; anything else is named (it raised AttributeError)."""
    from transformers import AutoTokenizer

    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.embedded import cache_dir, load_embedded
    from specresearch.models.families import perturbed_copy, tiny_family_model

    def pair():
        target = tiny_family_model("qwen2", "sdpa")
        return target, perturbed_copy(target, noise=0.3)

    kwargs = dict(gamma=2, max_new_tokens=8, seed=1)
    target, draft = pair()
    want = specresearch.speculative_generate(CausalLM(target, device="cpu"), CausalLM(draft, device="cpu"), [[1, 2, 3]],
                                             **kwargs)
    kwargs["chat"] = False
    target, draft = pair()
    assert specresearch.generate([[1, 2, 3]], target=target, draft=draft, **kwargs).tokens == want.tokens
    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
        load_embedded(device="cpu")  # its tokenizer, saved beside the checkpoint
    AutoTokenizer.from_pretrained(cache_dir() / "smollm2-135m-instruct", local_files_only=True).save_pretrained(tmp_path)
    target, draft = pair()
    target.save_pretrained(tmp_path)
    assert specresearch.generate([[1, 2, 3]], target=str(tmp_path), draft=draft, **kwargs).tokens == want.tokens
    with pytest.raises(TypeError, match="target must be a name, a checkpoint directory, a transformers causal LM"):
        specresearch.generate([[1, 2, 3]], target=3, draft="ngram", **kwargs)


def test_generate_fits_a_draft_model_of_another_width_and_takes_one_for_the_embedded_target():
    """A transformers draft whose rows and the target's hold every id of the tokenizer, but another number of them
    (Qwen2.5-0.5B's 151,936 against Qwen2.5-7B's 152,064), runs fitted to the target's width: greedy, the target's
    own tokens; without a tokenizer to tell padding rows, the engine refuses it naming the fix. A draft model given
    without a target runs against the embedded one (it was handed to the engine unwrapped and refused)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from specresearch.config import SamplingConfig
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.embedded import load_embedded
    from specresearch.models.families import tiny_family_config, tiny_family_model
    from specresearch.models.widths import output_rows

    greedy = dict(chat=False, gamma=2, max_new_tokens=8, sampling=SamplingConfig(temperature=0.0))
    width = output_rows(tiny_family_model("qwen2", "sdpa"))

    def draft():
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(tiny_family_config("qwen2", vocab_size=width + 8)).eval()

    vocab = {"<unk>": 0, "x": 1, "y": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    want = specresearch.autoregressive_generate(CausalLM(tiny_family_model("qwen2", "sdpa"), device="cpu"), [[1, 2, 1]],
                                                max_new_tokens=8, sampling=greedy["sampling"])
    out = specresearch.generate([[1, 2, 1]], target=tiny_family_model("qwen2", "sdpa"), draft=draft(),
                                tokenizer=tokenizer, **greedy)
    assert out.tokens == want.tokens
    with pytest.raises(ValueError, match=rf"CausalLM\(model, vocab_size={width}\)"):
        specresearch.generate([[1, 2, 1]], target=tiny_family_model("qwen2", "sdpa"), draft=draft(), **greedy)
    embedded, _ = load_embedded(device="cpu")
    torch.manual_seed(2)
    small = AutoModelForCausalLM.from_config(tiny_family_config("llama", vocab_size=embedded.vocab_size)).eval()
    out = specresearch.generate([[1, 2, 1]], draft=small, **greedy)
    want = specresearch.autoregressive_generate(embedded, [[1, 2, 1]], max_new_tokens=8, sampling=greedy["sampling"])
    assert out.tokens == want.tokens


def test_generate_refuses_a_prompt_the_target_cannot_read_before_it_times_anything(monkeypatch):
    """A token id past the target's vocabulary fails with the engine's error (as a prompt too long for its context
    does) before ``gamma="auto"`` times this machine's step costs (tens of seconds on a large model)."""
    import specresearch.engine.cost as cost

    monkeypatch.setattr(cost, "default_config", lambda *args, **kwargs: pytest.fail("timed before checking the prompt"))
    target = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    draft = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, vocab_size=8\)"):
        specresearch.generate([[1, 2, 8]], target=target, draft=draft, chat=False)

def test_generate_takes_the_machines_gamma_for_a_chain_and_the_measured_one_for_trees(monkeypatch, capsys):
    """``gamma="auto"`` (the default, as the CLI): ``engine.cost.default_config`` for a chain (trees weighed only with
    the default draft and verifier); ``GENERATE_GAMMA`` with ``num_drafts > 1`` or ``stop_below``, where the
    machine's step costs say nothing; a tree the machine picks is what runs."""
    import specresearch.engine.cost as cost
    from specresearch.config import GENERATE_GAMMA

    asked, answer = [], {"gamma": 3}
    monkeypatch.setattr(cost, "default_config", lambda target, draft, temperature, **kwargs: asked.append(
        (draft, temperature, kwargs["trees"])) or (kwargs["announce"] or print)("timing") or dict(answer))
    target = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    draft = ToyLM(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))
    chain = specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=12, seed=0)
    assert asked == [(draft, 1.0, False)] and max(s.gamma for s in chain.steps) == 3
    assert capsys.readouterr().err == "timing\n"  # told on stderr, as the CLI; announce=None is silent
    told = []
    specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=2, announce=told.append)
    specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=2, announce=None)
    assert told == ["timing"] and capsys.readouterr().err == "" and len(asked) == 3
    with pytest.raises(TypeError, match="announce must be a callable"):
        specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, announce=True)
    del asked[1:]
    tree = specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=12, seed=0,
                                 verifier="traversal", num_drafts=2)
    stop = specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=12, seed=0,
                                 stop_below=0.5)
    assert len(asked) == 1 and {s.gamma for s in tree.steps + stop.steps} <= {GENERATE_GAMMA}
    answer = cost.tree_options((2, 2, 3))
    picked = specresearch.generate([[1, 2, 3]], target=target, draft=draft, chat=False, max_new_tokens=12, seed=0,
                                   sampling=specresearch.SamplingConfig(temperature=0.0))
    assert asked[-1] == (draft, 0.0, False) and max(s.scored[0] for s in picked.steps) == 4  # the pending token + 3 nodes