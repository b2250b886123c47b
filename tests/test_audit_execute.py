"""audit.execute: transformers' own speculative code run on tiny random models, its law against the target's and
the encoded rule's prediction. Every chi-square decision here is at level 1e-3 with a fixed seed: a correct engine
fails a "keeps" assertion with probability 1e-3 over seeds, and these seeds are fixed."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from specresearch.audit.execute import ENGINES, captured_rows, cell_probs, execute, tv_interval
from specresearch.audit.llamacpp import llamacpp_home
from specresearch.experiments.executor import LocalExecutor
from specresearch.experiments.stats import law_from_rows
from specresearch.models.families import (
    perturbed_copy,
    tiny_dflash_pair,
    tiny_family_model,
    tiny_gemma4_pair,
    tiny_mtp_checkpoint,
    tiny_usd_pair,
)

PROMPT = [5, 9, 17, 3, 5, 9]  # repeats an n-gram, so prompt lookup finds candidates


def tiny_pair():
    """The tiny target and its perturbed copy as the draft (also a recipe executors' workers build)."""
    target = tiny_family_model("llama", "sdpa", seed=0, init_std=0.5)
    return target, perturbed_copy(target, noise=1.0, seed=3)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def run(pair, engine, **kwargs):
    target, draft = pair
    kwargs.setdefault("n_tokens", 1 if engine == "transformers-sampling" else 2)
    return execute(engine, prompt=PROMPT, target=target, draft=draft, progress=False, **kwargs)


def test_speculative_sampling_is_lossless_and_its_ensemble_form_lossy_as_predicted(pair):
    exact = run(pair, "transformers-sampling", num_samples=4000)
    assert exact.verdict == "exact" and exact.target.p_value > 1e-3 and exact.finding.startswith("agrees")
    assert exact.predicted_probs == exact.target_probs and sum(exact.counts) == 4000
    lossy = run(pair, "transformers-sampling", num_samples=4000, assistant_ensemble_weight=0.3)
    assert lossy.verdict == "not exact" and lossy.predicted.tv_from_target > 0.05
    assert lossy.target.p_value < 1e-3 < lossy.predicted.p_value  # the target's law rejected, the prediction kept
    assert lossy.finding.startswith("agrees: lossy")


def test_assisted_generation_and_prompt_lookup_keep_the_target_law(pair):
    assisted = run(pair, "transformers-assisted", num_samples=300, min_expected=10)
    lookup = run(pair, "transformers-lookup", num_samples=300, min_expected=10, prompt_lookup_num_tokens=2)
    for result in (assisted, lookup):
        assert result.n_tokens == 2 and len(result.cells) >= 4 and result.target.p_value > 1e-3, str(result)
    lossy = run(pair, "transformers-assisted", num_samples=300, min_expected=10, assistant_ensemble_weight=0.3)
    assert lossy.predicted.p_value > 1e-3 and lossy.target.p_value < 1e-3, str(lossy)


def _accept_every_draft(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs):
    """A broken ``_speculative_sampling``: every draft kept, the target sampled after them (a negative control)."""
    drafted = candidate_input_ids[:, -candidate_length:]
    bonus = torch.multinomial(new_logits[0, -1].softmax(-1), 1)[None]
    return torch.cat([drafted, bonus], 1), candidate_length


def test_transformers_mtp_drafting_keeps_the_target_law_and_a_verifier_accepting_all_does_not(tmp_path, monkeypatch):
    """transformers' generate(use_mtp=True) on a tiny Mellum checkpoint with an MTP layer (models.families
    .tiny_mtp_checkpoint): the run verifies MTP drafts (its notes count them) and keeps the target's law over the first
    two tokens (300 runs); with transformers' verification replaced by one accepting every draft, the same run
    rejects it (both at level 1e-3, fixed seeds). A target is required: the embedded model has no MTP layers."""
    from transformers import AutoModelForCausalLM
    from transformers.generation import utils

    tiny_mtp_checkpoint(tmp_path / "m", "mellum")
    target = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    common = dict(prompt=[5, 9, 3], n_tokens=2, num_samples=300, min_expected=10, target=target, progress=False)
    result = execute("transformers-mtp", **common)
    assert result.verdict == "exact" and result.target.p_value > 1e-3 and result.finding.startswith("agrees"), str(result)
    assert "MTP-drafted token" in result.notes[0]

    monkeypatch.setattr(utils, "_speculative_sampling", _accept_every_draft)
    broken = execute("transformers-mtp", **common)
    assert broken.target.p_value < 1e-3, str(broken)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs target="):
        execute("transformers-mtp", prompt=[5, 9, 3], num_samples=100, progress=False)


def test_transformers_dflash_drafting_keeps_the_target_law_and_a_verifier_accepting_all_does_not(monkeypatch):
    """transformers' DFlash path (``speculation_type="dflash"``) on a tiny Llama with a DFlash block drafter
    (``models.families.tiny_dflash_pair``): the run verifies DFlash drafts and keeps the target's law over the first
    two tokens (400 runs); with the verification replaced by one accepting every draft, the same run rejects it (both
    at level 1e-3, fixed seeds)."""
    from transformers.generation import utils

    target, assistant = tiny_dflash_pair()
    common = dict(prompt=[5, 9, 3], n_tokens=2, num_samples=400, min_expected=10, target=target, draft=assistant,
                  progress=False)
    result = execute("transformers-dflash", **common)
    assert result.verdict == "exact" and result.target.p_value > 1e-3 and result.finding.startswith("agrees"), str(result)
    assert "DFlash-drafted token" in result.notes[0]

    monkeypatch.setattr(utils, "_speculative_sampling", _accept_every_draft)
    assert execute("transformers-dflash", **common).target.p_value < 1e-3


def test_transformers_early_exit_keeps_the_target_law_and_a_verifier_accepting_all_does_not(monkeypatch):
    """transformers' early-exit self-speculation (``assistant_early_exit=1``: the first of the tiny Llama's two
    layers, its norm and head draft; no draft model): the run verifies such drafts and keeps the target's law over
    the first two tokens (400 runs); with the verification replaced by one accepting every draft, the same run rejects
    it (both at level 1e-3, fixed seeds). The target's own generation config is as it was after the run."""
    from transformers.generation import utils

    target = tiny_family_model("llama", "sdpa", seed=0, init_std=0.5)
    config = target.generation_config.to_dict()
    common = dict(prompt=[5, 9, 3], n_tokens=2, num_samples=400, min_expected=10, target=target, progress=False,
                  assistant_early_exit=1)
    result = execute("transformers-early-exit", **common)
    assert result.verdict == "exact" and result.target.p_value > 1e-3 and result.finding.startswith("agrees"), str(result)
    assert "early-exit-drafted token" in result.notes[0] and target.generation_config.to_dict() == config
    monkeypatch.setattr(utils, "_speculative_sampling", _accept_every_draft)
    assert execute("transformers-early-exit", **common).target.p_value < 1e-3
    with pytest.raises(ValueError, match="needs assistant_early_exit"):
        execute("transformers-early-exit", prompt=[5, 9, 3], num_samples=20, target=target, progress=False)


def test_the_gemma4_assistant_path_is_lossy_as_predicted():
    """transformers 5.25's Gemma 4 assistant path (``SinglePositionMultiTokenCandidateGenerator``) drafts the
    assistant's argmax and hands its logits to ``_speculative_sampling`` as q: on a tiny Gemma 4 pair
    (``models.families.tiny_gemma4_pair``) at T = 1, 2,000 runs reject the target's law and keep the law the rule
    ``hf-assisted`` with ``assistant="greedy"`` predicts from the rows transformers verifies with (level 1e-3 each,
    fixed seed)."""
    target, assistant = tiny_gemma4_pair()
    result = execute("transformers-gemma4-assistant", prompt=[5, 9, 17, 3], n_tokens=2, num_samples=2000,
                     target=target, draft=assistant, min_expected=10, progress=False)
    assert result.verdict == "not exact" and result.finding.startswith("agrees: lossy"), str(result)
    assert result.target.p_value < 1e-3 < result.predicted.p_value and result.predicted.tv_from_target > 0.05


def test_universal_speculative_decoding_with_a_pruned_head_is_lossy_as_predicted():
    """transformers 5.25's speculative decoding across vocabularies (``UniversalSpeculativeDecodingGenerator``) on a
    tiny pair whose assistant has 12 words the target lacks (``models.families.tiny_usd_pair``): transformers prunes
    the assistant's head to the shared tokens in ``get_vocab()``'s order and writes those logits to the target's ids
    in the order of the assistant's ids, so the q it verifies with is the draft's law on other tokens' ids (far from
    it in TV). 600 runs at T = 1 reject the target's law and keep the law predicted from the draft's own law and the
    captured rows (level 1e-3 each, fixed seed)."""
    target, draft, target_tokenizer, assistant_tokenizer = tiny_usd_pair()
    result = execute("transformers-usd", prompt=target_tokenizer("w9 w12 w30")["input_ids"], n_tokens=2,
                     num_samples=600, target=target, draft=draft, tokenizer=target_tokenizer,
                     assistant_tokenizer=assistant_tokenizer, min_expected=20, progress=False)
    assert result.verdict == "not exact" and result.finding.startswith("agrees: lossy"), str(result)
    assert result.target.p_value < 1e-3 < result.predicted.p_value and result.draft_tv_intended > 0.3
    assert "prunes its head" in result.notes[0]


def test_universal_speculative_decoding_fails_where_the_assistant_vocabulary_is_a_subset():
    """The same path with an assistant whose words are all the target's (no token to prune): transformers 5.25 still
    reads the pruned head's index, which it built only where something was pruned, and fails on the first draft (its
    PR 45320 mended the same guard in ``unmap_input_ids`` only). The runner names the two tokenizers it needs."""
    target, draft, target_tokenizer, assistant_tokenizer = tiny_usd_pair(assistant_only=0)
    common = dict(prompt=target_tokenizer("w9 w12 w30")["input_ids"], n_tokens=2, num_samples=20, target=target,
                  draft=draft, tokenizer=target_tokenizer, progress=False)
    with pytest.raises(AttributeError, match="assistant_overlap_token_ids"):
        execute("transformers-usd", assistant_tokenizer=assistant_tokenizer, **common)
    with pytest.raises(ValueError, match="assistant_tokenizer="):
        execute("transformers-usd", **common)
    with pytest.raises(ValueError, match="temperature alone"):
        execute("transformers-usd", assistant_tokenizer=assistant_tokenizer, top_k=20, **common)
    with pytest.raises(ValueError, match="num_assistant_tokens must be >= n_tokens"):
        execute("transformers-usd", assistant_tokenizer=assistant_tokenizer, num_assistant_tokens=1, **common)


@pytest.mark.parametrize("assistant_only", [12, 0])
def test_greedy_decoding_across_vocabularies_gives_the_targets_greedy_tokens(assistant_only):
    """Greedy (``do_sample=False``), transformers takes its other candidate generator across vocabularies
    (``AssistedCandidateGeneratorDifferentTokenizers``: no pruned head, drafts matched to the target's tokens): on both
    tiny pairs, with and without tokens only the draft has, it gives ``generate``'s greedy tokens, 12 of them after
    three prompts. The permuted q above is the sampling path's alone."""
    target, draft, target_tokenizer, assistant_tokenizer = tiny_usd_pair(assistant_only=assistant_only)
    for text in ("w9 w12 w30", "w1 w2 w40 w41", "w20"):
        ids = torch.tensor([target_tokenizer(text)["input_ids"]])
        common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=1)
        across = target.generate(ids, assistant_model=draft, tokenizer=target_tokenizer,
                                 assistant_tokenizer=assistant_tokenizer, **common)
        assert across.tolist() == target.generate(ids, **common).tolist(), text


def test_the_assistant_verified_with_twice_warped_rows(pair):
    """transformers 5.24 passes the main logits processors (its warpers included) to the assistant's generate, which
    builds its own from the same config: at T != 1 the drafts come from softmax(z / T^2), and that is the q it verifies
    with. Lossless still; the draft it runs is not the one asked for. At T = 1, no warpers: none."""
    cold = run(pair, "transformers-sampling", num_samples=200, temperature=0.5)
    plain = run(pair, "transformers-sampling", num_samples=200)
    assert cold.draft_tv_intended > 0.05 and cold.notes
    assert plain.draft_tv_intended < 1e-6 and not plain.notes


def test_cell_probs_of_the_law_itself_are_its_cells():
    generator = torch.Generator().manual_seed(0)
    table = {}

    def rows(prefixes):
        out = []
        for prefix in prefixes:
            if prefix not in table:
                logits = 2 * torch.randn(6, generator=generator, dtype=torch.float64)
                logits[5] = -float("inf")  # a token the target never emits
                table[prefix] = logits.softmax(-1)
            out.append(table[prefix])
        return torch.stack(out)

    law = law_from_rows(rows, [1, 2], sampling=None, k=2, num_samples=500)
    probs, impossible = cell_probs(law, law.rows)
    assert impossible == 0 and np.allclose(probs, law.probs, atol=1e-12)
    other = {prefix: torch.full((6,), 1 / 6, dtype=torch.float64) for prefix in law.rows}
    probs, impossible = cell_probs(law, other)
    expanded = sum(len(prefix) == 1 for prefix in law.rows)  # token 5 is reached from the root and from these
    assert expanded >= 1 and impossible == pytest.approx(1 / 6 + expanded / 36)
    assert sum(probs) + impossible == pytest.approx(1.0)


def test_tv_interval_and_noise_floor():
    probs = np.full(10, 0.1)
    tv, (low, high), floor = tv_interval(np.full(10, 100), probs)
    assert tv == 0 and low == 0 and floor > 0.01
    tv, (low, high), _ = tv_interval([400, 600], [0.5, 0.5])
    assert tv == pytest.approx(0.1) and 0.05 < low < 0.1 < high < 0.15


def test_captured_rows_restores_the_function():
    from transformers.generation import utils

    original = utils._speculative_sampling
    with captured_rows() as calls:
        assert utils._speculative_sampling is not original and calls == []
    assert utils._speculative_sampling is original


@pytest.mark.parametrize("kwargs, message", [
    (dict(engine="vllm"), "engine must be one of"),
    (dict(engine="transformers-assisted", top_q=3), "takes options"),
    (dict(engine="transformers-sampling", n_tokens=2), "n_tokens=1"),
    (dict(engine="transformers-lookup"), "prompt_lookup_num_tokens"),
    (dict(engine="transformers-assisted", temperature=0.0), "temperature"),
    (dict(engine="transformers-assisted", num_samples=5), "num_samples"),
    (dict(engine="llamacpp-server", n_tokens=1), "n_tokens >= 2"),
    (dict(engine="transformers-mtp", n_tokens=1), "n_tokens >= 2"),
    (dict(engine="transformers-mtp", prompt_lookup_num_tokens=2), "takes options"),
    (dict(engine="transformers-gemma4-assistant", n_tokens=1), "n_tokens >= 2"),
    (dict(engine="transformers-dflash", n_tokens=1), "n_tokens >= 2"),
    (dict(engine="transformers-assisted", assistant_ensemble_weight=0.5, num_assistant_tokens=1),
     "num_assistant_tokens must be >= n_tokens"),
    (dict(engine="llamacpp-server", assistant_ensemble_weight=0.5), "takes options"),
    (dict(engine="llamacpp-example", n_tokens=3), "n_tokens=2"),
    (dict(engine="llamacpp-example", synth_rates=(0.5,)), "takes options"),
    (dict(engine="python"), "needs sample="),
    (dict(engine="python", sample=None), "must be callable"),
    (dict(engine="python", sample=print, sampler=print), "one of the two"),
    (dict(engine="python", sample=print, top_k=5), "need target_law="),
    (dict(engine="llamacpp-server", top_k=500), "llamacpp-server needs top_k in 1..200"),
    (dict(engine="llamacpp-example", top_k=0), "llamacpp-example needs top_k"),
    (dict(engine="llamacpp-simple", top_k=0), "llamacpp-simple needs top_k"),
    (dict(engine="llamacpp-example", n_parallel=5), "llamacpp-example: n_parallel in 1..4"),
])
def test_bad_input_is_refused(pair, kwargs, message):
    kwargs = dict(num_samples=100) | kwargs
    with pytest.raises(ValueError, match=message):
        execute(prompt=PROMPT, target=pair[0], draft=pair[1], progress=False, **kwargs)
    assert set(ENGINES) == {"transformers-assisted", "transformers-lookup", "transformers-sampling", "transformers-mtp",
                            "transformers-gemma4-assistant", "transformers-dflash", "transformers-usd",
                            "transformers-early-exit", "llamacpp-server",
                            "llamacpp-example",
                            "llamacpp-simple", "python"}


LLAMACPP = llamacpp_home() / "bin" / "llama-server"


@pytest.mark.skipif(not LLAMACPP.is_file(), reason="llama.cpp is not built on this machine (bash scripts/build_llamacpp.sh, "
                    "tens of minutes; the committed record benchmarks/records/audit_executed.json carries its results)")
def test_llamacpp_server_keeps_the_target_law_and_its_synthetic_mode_the_predicted_one():
    from specresearch.drafts.registry import load_pair

    target, _, tokenizer = load_pair(draft="ngram", device="cpu", skinny_linear=False)
    common = dict(prompt="Name a colour.", n_tokens=2, num_samples=600, target=target.model, tokenizer=tokenizer,
                  progress=False, min_expected=10)
    exact = execute("llamacpp-server", **common | {"num_samples": 300})  # a check that it keeps p (FPR 1e-3)
    assert exact.target.p_value > 1e-3 and exact.version.startswith("llama.cpp"), str(exact)
    # With a request seed the server seeds its synthetic-acceptance coins with the sampler's own seed, so the coin
    # and the target's first draw coincide: the most likely first token is always followed by the kept draft token,
    # and the law is neither the target's nor the rule's (docs/audit.md, "Their code, run").
    synthetic = execute("llamacpp-server", synth_rates=(0.5, 0.25, 0.125), temperature=0.8, **common)
    assert synthetic.predicted.tv_from_target > 0.05, str(synthetic)
    assert synthetic.target.p_value < 1e-3 and synthetic.predicted.p_value < 1e-3, str(synthetic)
    assert synthetic.finding.startswith("FINDING"), str(synthetic)


@pytest.mark.skipif(not LLAMACPP.is_file(), reason="llama.cpp is not built on this machine (bash scripts/build_llamacpp.sh, "
                    "tens of minutes)")
@pytest.mark.parametrize("sampling", [dict(top_k=40, top_p=0.95, min_p=0.05, temperature=1.0),
                                      dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8),
                                      dict(top_k=100, top_p=0.5, min_p=0.0, temperature=0.7),
                                      dict(top_k=200, top_p=1.0, min_p=0.1, temperature=1.3)])
def test_the_sampler_chain_is_llama_servers_own(sampling, tmp_path, monkeypatch):
    """audit.real.llamacpp_chain on the server's raw next-token law (its full softmax's top 200) gives the lists its
    sampler chain leaves (post_sampling_probs): the same tokens, the probabilities within float32 rounding. The
    server's log is removed when it stops cleanly."""
    import math

    from specresearch.audit.llamacpp import LlamaServer
    from specresearch.audit.real import llamacpp_chain
    from specresearch.models.embedded import gguf_path

    vocab = 49152
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    with LlamaServer(gguf_path()) as server:
        for tokens in ([1, 9690, 198, 2683], [1, 504, 3295, 282, 253], [1, 9690, 198, 2683, 359, 253, 5356]):
            reply = server.complete(tokens, n_predict=1, n_probs=200, post_sampling_probs=False, **sampling)
            raw = torch.zeros(1, vocab, dtype=torch.float64)
            for entry in reply["completion_probabilities"][0]["top_logprobs"]:
                raw[0, int(entry["id"])] = math.exp(entry["logprob"])
            ours, theirs = llamacpp_chain(raw, **sampling)[0], server.row(tokens, vocab, sampling)
            assert torch.equal(ours > 0, theirs > 0), (tokens, sampling)
            assert torch.allclose(ours, theirs, atol=2e-6), (tokens, sampling)
        assert Path(server.log.name).parent == tmp_path and Path(server.log.name).is_file()
    assert not list(tmp_path.iterdir())


def test_a_row_is_asked_again_when_the_drawn_token_ends_inside_a_character():
    """llama-server leaves a sampled token out of its reply, probabilities and all, while its text ends inside a UTF-8
    character; LlamaServer.row draws again with another seed (the law does not depend on the draw), and says so
    when every draw is such a token."""
    from specresearch.audit.llamacpp import LlamaServer

    class Replies(LlamaServer):
        def __init__(self, partial: int):
            self.partial, self.seeds = partial, []

        def complete(self, tokens, **request):
            self.seeds.append(request["seed"])
            if len(self.seeds) <= self.partial:
                return {"content": "\ufffd", "completion_probabilities": []}
            return {"completion_probabilities": [{"top_probs": [{"id": 3, "prob": 0.75}, {"id": 1, "prob": 0.25}]}]}

    sampling = dict(top_k=40, top_p=0.95, min_p=0.05, temperature=1.0)
    server = Replies(partial=2)
    assert server.row([1, 2], 5, sampling).tolist() == [0, 0.25, 0, 0.75, 0] and server.seeds == [0, 1, 2]
    with pytest.raises(RuntimeError, match="inside a UTF-8 character"):
        Replies(partial=10**6).row([1, 2], 5, sampling)


def test_llama_speculatives_tokens_are_read_from_its_debug_log():
    from specresearch.audit.llamacpp import simple_steps, simple_tokens, speculative_tokens
    from specresearch.audit.runners import padded

    log = ("D the sampled target token (1205, 'Blue') did not match, or we ran out of drafted tokens\n"
           "D verifying sequence #0 at pos #0 from 1 active sequence(s)\n"
           "D draft token 0 of sequence 0 (30, '.') accepted\n"
           "D draft token 1 of sequence 1 (2, ''') accepted\nBlue.\n"
           "D draft token 2 of sequence 0 (198, '\n') accepted\n"
           "D r = 0.835181, p_dft = 0.490691, p_tgt = 0.370892\n"
           "D draft token 3 of sequence 0 (290, 'le') rejected\n"  # not emitted: the residual's draw is
           "D all drafted tokens were rejected, sampling from residual distribution\n"
           "D the sampled target token (7302, ' colour') did not match, or we ran out of drafted tokens\n")
    assert speculative_tokens(log) == [1205, 30, 2, 198, 7302]
    assert speculative_tokens("no tokens here") == []
    simple = ("D spec        draft:  - seq_id 0, draft candidate   0, pos   0:     29 (   0.848) '-'\n"
              "D spec        draft:  - seq_id 0, draft candidate   1, pos   0:     28 (   0.072) ','\n"
              "D accepted 1/1 draft tokens, the last target token is: (12018)\n"
              "D spec        draft:  - seq_id 0, draft candidate   0, pos   0:     29 (   0.983) '-'\n"
              "D spec        draft:  - seq_id 0, draft candidate   0, pos   1:   1222 (   0.447) 'day'\n"
              "D accepted 0/2 draft tokens, the last target token is: (2256)\n")
    assert simple_tokens(simple) == [29, 12018, 2256]
    assert simple_steps(simple) == [([29], 1, 12018), ([29, 1222], 0, 2256)]
    assert padded([5, 2, 7, 8], 3, eos=2) == [5, 2, 2]  # EOS absorbing: nothing after it counts


def test_a_speculative_run_whose_log_was_cut_short_is_run_again(monkeypatch):
    """llama.cpp's examples log from a thread of their own and may exit before it has written their last lines (seen
    here on a loaded machine: a generation's second token missing, which read as an end of generation). A log without
    the counts printed after the loop is run again with the same seed; five cut logs in a row are an error, and a
    generation logged short without an end of generation is refused, not padded."""
    import subprocess

    import specresearch.audit.llamacpp as llamacpp
    from specresearch.audit.runners import LlamaSpeculativeRun

    step = "D accepted 0/1 draft tokens, the last target token is: (12018)\n"
    draft = "D spec        draft:  - seq_id 0, draft candidate   0, pos   0:     29 (   0.983) '-'\n"
    whole = draft + step + draft + "D accepted 1/1 draft tokens, the last target token is: (7)\nI n_accept  = 1\n"
    cut = draft + step
    logs, commands = [cut, cut, whole], []

    def fake_run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="", stderr=logs.pop(0))

    monkeypatch.setattr(llamacpp, "llamacpp_bin", lambda name: Path("/bin") / name)
    monkeypatch.setattr(llamacpp.subprocess, "run", fake_run)
    sampling = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    tokens = llamacpp.run_speculative("t.gguf", "d.gguf", "Hi", seed=11, n_predict=2, sampling=sampling, simple=True)
    assert tokens == [12018, 29, 7] and len(commands) == 3 and len({tuple(c) for c in commands}) == 1  # the same seed
    logs[:] = [cut] * 5
    with pytest.raises(RuntimeError, match="cut short in 5 runs of seed 11"):
        llamacpp.run_speculative("t.gguf", "d.gguf", "Hi", seed=11, n_predict=2, sampling=sampling, simple=True)

    run = LlamaSpeculativeRun.__new__(LlamaSpeculativeRun)
    run.seed, run.n_tokens, run.eos, run.jobs, run.simple, run.notes = 0, 2, 2, 1, True, []
    run.model = run.draft = run.text = run.sampling = run.n_parallel = run.draft_max = run.p_split = None
    monkeypatch.setattr(llamacpp, "run_speculative", lambda *a, **k: ([12018], "I n_accept  = 0\n"))
    with pytest.raises(RuntimeError, match="logged 1 tokens of 2 and no end of generation"):
        list(run.draws(1))
    monkeypatch.setattr(llamacpp, "run_speculative", lambda *a, **k: ([2], "I n_accept  = 0\n"))
    assert list(run.draws(1)) == [[2, 2]]  # an end of generation, EOS absorbing


SPECULATIVE = llamacpp_home() / "bin" / "llama-speculative"


@pytest.mark.skipif(not (SPECULATIVE.is_file() and LLAMACPP.is_file()), reason="llama.cpp is not built on this "
                    "machine (bash scripts/build_llamacpp.sh); the committed record audit_executed.json carries its results")
def test_llama_speculative_follows_its_list_residual_and_speculative_simple_the_target():
    """llama-speculative (one branch, the scaled draft, T = 0.8 as it defaults) at N = 100 (a process a generation,
    about a second each): the target's law is rejected (its draft is the argmax, the residual paired by list
    position; the predicted law is TV ~0.29 from the target's, p ~4e-9 at these seeds) and the predicted one is not
    (FPR 1e-3 for that half). At this N the run need not reject the textbook residual, so that comparison is only
    checked to be there."""
    from specresearch.drafts.registry import load_pair

    target, _, tokenizer = load_pair(draft="ngram", device="cpu", skinny_linear=False)
    result = execute("llamacpp-example", prompt="Name a colour.", n_tokens=2, num_samples=100, temperature=0.8,
                     target=target.model, tokenizer=tokenizer, progress=False, min_expected=10)
    assert result.verdict == "not exact" and "llama-speculative" in result.version, str(result)
    assert result.predicted.p_value > 1e-3 and result.target.p_value < 1e-3, str(result)
    assert set(result.alternatives) == {"residual p - q token by token"}
    assert result.as_record()["alternatives"]["residual p - q token by token"]["p_value"] >= 0
    # llama-speculative-simple, the server's loop: exact, the target's law kept (FPR 1e-3)
    simple = execute("llamacpp-simple", prompt="Name a colour.", n_tokens=2, num_samples=60, temperature=0.8,
                     target=target.model, tokenizer=tokenizer, progress=False, min_expected=10)
    assert simple.verdict == "exact" and simple.target.p_value > 1e-3, str(simple)


class CountingExecutor(LocalExecutor):
    def __init__(self):
        self.blocks = 0

    def run(self, function, blocks, on_result=None):
        self.blocks += len(blocks)
        return super().run(function, blocks, on_result)


def test_a_stopped_run_resumes_from_its_stored_blocks(pair, tmp_path):
    """blocks_file=: every finished seed block is stored; a run stopped after two of three blocks draws only the
    third when run again and counts what the uninterrupted run counts; a file of another run is refused."""
    common = dict(n_tokens=1, num_samples=3000, seed=4, batch_size=1000, models=functools.partial(tiny_pair))
    path = tmp_path / "blocks.jsonl"
    whole = run(pair, "transformers-sampling", executor=LocalExecutor(), **common)
    stored = run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=path, **common)
    lines = path.read_text().splitlines()
    assert stored.counts == whole.counts and len(lines) == 4 and sum(whole.counts) == 3000
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:40])  # killed while writing its third block
    counting = CountingExecutor()
    resumed = run(pair, "transformers-sampling", executor=counting, blocks_file=path, **common)
    assert counting.blocks == 1 and resumed.counts == whole.counts and len(path.read_text().splitlines()) == 4
    assert path.read_text().splitlines()[:3] == lines[:3]  # the kept lines as they were written
    assert resumed.seconds > 0
    with pytest.raises(ValueError, match="blocks of another run"):
        run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=path, **common | {"seed": 5})
    with pytest.raises(ValueError, match="pass an executor"):
        run(pair, "transformers-sampling", blocks_file=path, num_samples=3000)


def test_a_run_refuses_to_pool_blocks_drawn_on_another_machine(pair, tmp_path, monkeypatch):
    """Each stored block names the machine that drew it (``audit.execute.block_machine``); a resumed run whose stored
    blocks came from another kind of machine refuses to draw beside them (the first llamacpp-simple power run pooled
    two machines' laws into a finding), and blocks written before blocks named their machine are counted in the
    result's notes, not refused. The result (and its record row) names the machines its generations came from, and
    the commits of the code that drew them (each block's, recorded, not compared)."""
    import json

    from specresearch.audit.blocks import block_machine

    monkeypatch.setenv("SPECRESEARCH_COMMIT", "feedbee")  # what records.git_commit names, with or without a .git
    common = dict(n_tokens=1, num_samples=3000, seed=4, batch_size=1000, models=functools.partial(tiny_pair))
    path = tmp_path / "blocks.jsonl"
    whole = run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=path, **common)
    header, *blocks = [json.loads(line) for line in path.read_text().splitlines()]
    assert [b["machine"] for b in blocks] == [block_machine()] * 3 and not any("no machine" in n for n in whole.notes)
    assert whole.machines == (block_machine(),) and whole.as_record()["machines"] == [block_machine()]
    assert [b["commit"] for b in blocks] == ["feedbee"] * 3
    assert whole.commits == ("feedbee",) and whole.as_record()["commits"] == ["feedbee"]
    other = dict(block_machine(), cpu_flags=["avx512f"] if "avx512f" not in block_machine()["cpu_flags"] else [])
    lines = [header, {**blocks[0], "machine": other}, blocks[1]]  # the third block to draw here
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    counting = CountingExecutor()
    with pytest.raises(ValueError, match="one kind of machine"):
        run(pair, "transformers-sampling", executor=counting, blocks_file=path, **common)
    assert counting.blocks == 0  # refused before drawing
    unstamped = {k: v for k, v in blocks[0].items() if k not in ("machine", "commit")}  # an older block
    lines = [header, unstamped, {**blocks[1], "commit": "0123abc"}]  # one drawn at another commit: recorded, not refused
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    resumed = run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=path, **common)
    assert resumed.counts == whole.counts
    assert any("1 of the stored seed blocks carry no machine" in note for note in resumed.notes), resumed.notes
    assert resumed.machines == (block_machine(),)  # the unstamped block adds none
    assert resumed.commits == ("0123abc", "feedbee")  # in block order
    in_process = run(pair, "transformers-sampling", n_tokens=1, num_samples=20)
    assert in_process.machines == (block_machine(),) and in_process.commits == ("feedbee",)
    monkeypatch.setattr("specresearch.audit.execute.git_commit", lambda: "")  # a checkout that names no commit
    assert run(pair, "transformers-sampling", n_tokens=1, num_samples=20).commits == ()
    nameless = run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=tmp_path / "none.jsonl", **common)
    assert nameless.commits == () and "commit" not in json.loads((tmp_path / "none.jsonl").read_text().splitlines()[1])


def test_a_finished_runs_blocks_pack_and_read_the_same(pair, tmp_path):
    """``BlockStore.pack``: a finished run's blocks gzipped (the same bytes each time) give the same result when the
    run is read again, without drawing; a run still drawing is not packed, and one that draws more blocks into a packed
    file unpacks it first and appends."""
    import gzip

    from specresearch.audit.blocks import BlockStore, packed_path

    common = dict(n_tokens=1, seed=4, batch_size=1000, models=functools.partial(tiny_pair))
    path = tmp_path / "blocks.jsonl"
    whole = run(pair, "transformers-sampling", executor=LocalExecutor(), blocks_file=path, num_samples=2000, **common)
    text = path.read_text()
    packed = BlockStore.pack(path)
    assert packed == packed_path(path) and not path.exists() and gzip.decompress(packed.read_bytes()).decode() == text
    assert BlockStore.stored(packed) == BlockStore.stored(path) and BlockStore.finished(path)
    counting = CountingExecutor()
    again = run(pair, "transformers-sampling", executor=counting, blocks_file=path, num_samples=2000, **common)
    assert counting.blocks == 0 and again.counts == whole.counts and not path.exists()
    other = tmp_path / "other.jsonl"
    other.write_text(text.splitlines()[0].replace('"num_samples": 2000', '"num_samples": 3000') + "\n"
                     + "\n".join(text.splitlines()[1:]) + "\n")
    with pytest.raises(ValueError, match="has not drawn all"):
        BlockStore.pack(other)
    bigger = tmp_path / "bigger.jsonl"
    bigger.write_text(other.read_text())
    packed_path(bigger).write_bytes(gzip.compress(bigger.read_bytes()))
    bigger.unlink()
    counting = CountingExecutor()
    grown = run(pair, "transformers-sampling", executor=counting, blocks_file=bigger, num_samples=3000, **common)
    assert counting.blocks == 1 and bigger.exists() and not packed_path(bigger).exists()
    assert len(bigger.read_text().splitlines()) == 4 and sum(grown.counts) == 3000


def test_a_superseded_power_row_leaves_the_table_and_keeps_its_blocks(tmp_path, monkeypatch):
    """``audit_executed.py --supersede ENGINE --why TEXT``: that engine's power rows move to the record's ``superseded``
    list with the reason and where their blocks were put (packed), the blocks' file is gone so the next power run draws
    from nothing, the other rows stay; without a reason, or with no such row, it refuses."""
    import argparse
    import importlib.util
    import json

    from specresearch.audit.blocks import BlockStore

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("audit_executed", root / "benchmarks" / "audit_executed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "BLOCKS", tmp_path)
    engine, n_tokens, n, temperature, options, prompt, *_ = next(c for c in script.POWER if c[0] == "llamacpp-simple")
    args = argparse.Namespace(batch_size=500, scale=1.0, supersede=engine, why="pooled two machines")
    path = script.blocks_path(engine, n_tokens, temperature, options, prompt, n, args)
    lines = [{"run": {"num_samples": 1000}}, {"size": 500, "seed": 1, "seconds": 1.0, "draws": [[1, 2]]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = {"engine": engine, "n_tokens": n_tokens, "temperature": temperature, "options": options, "prompt": prompt}
    record = {"rows": [row, row | {"power_n": n}]}
    out = tmp_path / "record.json"
    moved = script.supersede(record, out, args)
    written = json.loads(out.read_text())
    assert len(moved) == 1 and written["rows"] == [row] and not path.exists()
    (gone,) = written["superseded"]
    assert gone["why"] == "pooled two machines" and gone["power_n"] == n and gone["blocks"].endswith(".superseded.jsonl.gz")
    assert BlockStore.stored(gone["blocks"])[1] == lines[1:]
    with pytest.raises(SystemExit, match="no power row"):
        script.supersede(written, out, args)
    with pytest.raises(SystemExit, match="needs --why"):
        script.supersede(record, out, argparse.Namespace(**vars(args) | {"why": None}))


def test_a_library_sampler_is_held_to_the_target_law(pair):
    """engine 'python': a correct sampler (plain sampling from the target) keeps the target's law; one that returns
    the draft's samples, as a verifier that accepts everything would, is a finding, and with that composition's law
    given as ``predicted_law`` it is lossy as predicted."""
    target, draft = pair
    generator = torch.Generator().manual_seed(5)

    def from_model(model):
        def sample(prompt, n_tokens):
            ids = list(prompt)
            for _ in range(n_tokens):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
                ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
            return ids[len(prompt):]
        return sample

    common = dict(prompt=PROMPT, n_tokens=2, num_samples=600, target=target, progress=False, min_expected=10)
    honest = execute("python", sample=from_model(target), name="plain sampling", **common)
    assert honest.target.p_value > 1e-3 and honest.finding.startswith("agrees"), str(honest)
    accepts_all = execute("python", sample=from_model(draft), name="accept every draft", **common)
    assert accepts_all.target.p_value < 1e-3 and accepts_all.finding.startswith("FINDING"), str(accepts_all)
    assert "sample" not in accepts_all.options and accepts_all.options["name"] == "accept every draft"
    eos = target.generation_config.eos_token_id

    def draft_law(law):  # the law that composition predicts: the draft's, token by token
        rows = dict(law.rows)
        for prefix in [x for x in law.rows if not x or x[-1] != eos]:
            with torch.no_grad():
                rows[prefix] = draft(input_ids=torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double().softmax(-1)
        return rows

    predicted = execute("python", sample=from_model(draft), predicted_law=draft_law, name="accept every draft", **common)
    assert predicted.verdict == "not exact" and "predicted_law" not in predicted.options
    assert predicted.finding.startswith("agrees: lossy as the audit predicts"), str(predicted)
    with pytest.raises(ValueError, match="predicted_law= must be callable"):
        execute("python", sample=from_model(draft), predicted_law=1, **common)


def test_a_library_with_sampling_settings_is_held_to_the_law_they_define(pair):
    """engine 'python' with ``target_law``: a sampler drawing from the law its settings define (here a repetition
    and a frequency penalty, audit.real.vllm_law) agrees with it; the same draws held to the plain law are a finding.
    The settings are recorded, the law is not."""
    from specresearch.audit.real import vllm_law

    target, _ = pair
    settings = {"repetition_penalty": 3.0, "frequency_penalty": 2.0}
    generator = torch.Generator().manual_seed(7)

    def law(ids, logits):
        return vllm_law(logits, PROMPT, ids[len(PROMPT):], **settings)

    def sample(prompt, n_tokens):
        ids = list(prompt)
        for _ in range(n_tokens):
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([ids])).logits[0, -1].double()
            ids.append(int(torch.multinomial(law(ids, logits), 1, generator=generator)))
        return ids[len(prompt):]

    common = dict(prompt=PROMPT, n_tokens=2, num_samples=600, target=target, progress=False, min_expected=10)
    held = execute("python", sample=sample, target_law=law, name="penalised sampling", **common, **settings)
    assert held.target.p_value > 1e-3 and held.finding.startswith("agrees"), str(held)
    assert held.options == {"name": "penalised sampling"} | settings
    plain = execute("python", sample=sample, name="penalised sampling", **common)
    assert plain.target.p_value < 1e-3 and plain.finding.startswith("FINDING"), str(plain)


def test_a_finding_counts_the_generations_the_target_cannot_emit(pair):
    """A sequence the target cannot emit (here a token id past its vocabulary, as a library with an added token could
    return) has a cell of expected count 0 that alone rejects the target's law: the finding says how many landed there."""
    target, _ = pair
    calls = iter(range(10**6))

    def sample(prompt, n_tokens):
        if next(calls) % 20 == 0:  # 1 in 20, deterministically
            return [target.config.vocab_size] * n_tokens
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([list(prompt)])).logits[0, -1].double()
        return [int(torch.multinomial(logits.softmax(-1), 1))] * n_tokens

    result = execute("python", sample=sample, prompt=PROMPT, n_tokens=1, num_samples=200, target=target,
                     progress=False, name="a token past the vocabulary")
    assert result.cells[-1] == ("outside the target's support",) and result.counts[-1] == 10
    assert result.finding.startswith("FINDING") and result.finding.endswith(
        "; 10 of 200 generations outside the target's support"), result.finding


def test_the_docs_table_is_the_records_one():
    """docs/audit.md's table of engines run is computed from the committed records (``audit.report.executed_table``)."""
    import json
    from pathlib import Path

    from specresearch.audit.report import EXECUTED_RECORDS, executed_table

    root = Path(__file__).resolve().parents[1]
    rows = [row for name in EXECUTED_RECORDS
            for row in json.loads((root / "benchmarks" / "records" / f"{name}.json").read_text())["rows"]]
    text = (root / "docs" / "audit.md").read_text()
    table = text.split("<!-- executed table: generated -->\n")[1].split("\n<!-- end of executed table -->")[0]
    assert table == executed_table(rows)
    assert any(row.get("engine") == "llamacpp-server" for row in rows)  # llama.cpp's results travel in the record
    assert any(row.get("engine") == "transformers-mtp" for row in rows)


def test_the_figure_shows_each_configuration_once_at_its_largest_n():
    """Notebook 12's figure (and ``audit_executed.py --docs``'s) has one panel a configuration: the power run where
    there is one, in the order the configurations first appear."""
    from specresearch.audit.report import config_key, largest_runs, row_config_key

    def row(engine, n, options=None, temperature=1.0):
        return {"engine": engine, "n_tokens": 2, "temperature": temperature, "options": options or {},
                "prompt": "Hi", "num_samples": n}

    rows = [row("a", 2000), row("b", 400, {"w": 0.5}), row("a", 24000), row("b", 400, {"w": 0.5}, 0.7),
            row("a", 8000), row("b", 22000, {"w": 0.5})]
    picked = largest_runs(rows)
    assert [(r["engine"], r["num_samples"], r["temperature"]) for r in picked] == [("a", 24000, 1.0), ("b", 22000, 1.0),
                                                                                ("b", 400, 0.7)]
    assert picked[0] is rows[2] and largest_runs([]) == []
    power = rows[2] | {"power_n": 24000}  # a power run is its own configuration, and the same one without its N
    assert row_config_key(power) == config_key("a", 2, 1.0, {}, "Hi", 24000) != row_config_key(rows[2])
    assert row_config_key(power, with_n=False) == row_config_key(rows[2]) == config_key("a", 2, 1.0, {}, "Hi")


@pytest.mark.skipif(not (llamacpp_home() / "gguf-py").is_dir(), reason="llama.cpp's gguf-py comes with its build "
                    "(bash scripts/build_llamacpp.sh); the drafts are written with it")
def test_the_gguf_drafts_are_the_target_scaled_and_truncated(tmp_path):
    import sys

    import numpy as np

    from specresearch.audit.llamacpp import write_scaled_draft, write_truncated_draft
    from specresearch.models.embedded import gguf_path

    sys.path.insert(0, str(llamacpp_home() / "gguf-py"))
    from gguf import GGUFReader

    target = GGUFReader(gguf_path())
    norm = lambda reader: np.array([t for t in reader.tensors if t.name == "output_norm.weight"][0].data)  # noqa: E731
    scaled = GGUFReader(write_scaled_draft(gguf_path(), tmp_path / "scaled.gguf", 1.5))
    assert np.allclose(norm(scaled), 1.5 * norm(target)) and len(scaled.tensors) == len(target.tensors)
    truncated = GGUFReader(write_truncated_draft(gguf_path(), tmp_path / "truncated.gguf", 2))
    arch = truncated.fields["general.architecture"].contents()
    assert truncated.fields[f"{arch}.block_count"].contents() == 2
    blocks = {int(t.name.split(".")[1]) for t in truncated.tensors if t.name.startswith("blk.")}
    assert blocks == {0, 1} and np.array_equal(norm(truncated), norm(target))


def test_the_power_runs_status_reads_their_blocks(tmp_path, monkeypatch):
    """``audit_executed.py --status``: a POWER configuration in the record is done; one with stored blocks shows its
    runs of N and the worker-hours left at its blocks' seconds a run (a block cut short not counted, and left in the file);
    one without, none."""
    import argparse
    import importlib.util
    import json

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("audit_executed", root / "benchmarks" / "audit_executed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "BLOCKS", tmp_path)
    args = argparse.Namespace(batch_size=500, scale=1.0)
    first, second, third = script.POWER[:3]
    engine, n_tokens, n, temperature, options, prompt, *_ = second
    path = tmp_path / f"{engine}-{script.blocks_name(engine, n_tokens, temperature, options, prompt, n, args)}.jsonl"
    path.write_text(json.dumps({"run": {}}) + "\n" + "".join(json.dumps({"size": 500, "seed": s, "seconds": 250.0,
                                                                          "draws": []}) + "\n" for s in (1, 2))
                    + '{"size": 500, "se')
    engine0, n_tokens0, n0, temperature0, options0, prompt0, *_ = first
    record = {"rows": [{"engine": engine0, "n_tokens": n_tokens0, "temperature": temperature0, "options": options0,
                        "prompt": prompt0, "power_n": n0}]}
    before = path.read_text()
    lines = script.status(args, record)
    assert path.read_text() == before  # read only: the cut line is the run's to drop when it resumes
    assert len(lines) == len(script.POWER) and lines[0].endswith("done, in the record")
    hours = (n - 1000) * 0.5 / 3600
    assert f"1000 of {n} runs in 2 blocks" in lines[1] and f"about {hours:.1f} worker-hours left at 0.50 s a run" in lines[1]
    assert f"0 of {third[2]} runs in 0 blocks" in lines[2] and "hours" not in lines[2]


def test_the_libraries_power_runs_are_those_that_kept_the_law_and_their_status_reads_their_blocks(tmp_path, monkeypatch):
    """``audit_libraries.py --power N --status``: only libraries whose smaller run kept the target's law get a power run
    (not one that did not run, nor one already a finding); one in the record at N is done; one with stored blocks shows
    its runs of N and the hours left at its blocks' seconds a run; the blocks' file is another for another N."""
    import argparse
    import importlib.util
    import json

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("audit_libraries", root / "benchmarks" / "audit_libraries.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "BLOCKS", tmp_path)
    args = argparse.Namespace(only=None, power=4000, batch_size=500, prompt="Hi", n_tokens=2, temperature=1.0, gamma=2)
    agrees = {"ran": True, "finding": "agrees: lossless as the audit says"}
    record = {"rows": [{"library": "specdec"} | agrees, {"library": "specdec", "power_n": 4000} | agrees,
                       {"library": "flashspec"} | agrees, {"library": "economize"} | agrees,
                       {"library": "seqspecdecod.capped_hsd", "ran": True, "finding": "FINDING: ..."},
                       {"library": "eagle-llm", "ran": False, "why": "..."}]}
    script.blocks_path("flashspec", args).write_text(
        json.dumps({"run": {}}) + "\n" + "".join(json.dumps({"size": 500, "seed": s, "seconds": 150.0, "draws": []}) + "\n"
                                                 for s in (1, 2, 3)))
    lines = script.status(args, record)
    assert [line.split(" N ")[0] for line in lines] == ["specdec", "flashspec", "economize"]
    assert lines[0] == "specdec N 4000: done, in the record"
    assert "1500 of 4000 runs in 3 blocks" in lines[1] and "about 0.2 worker-hours left at 0.30 s a run" in lines[1]
    assert "0 of 4000 runs in 0 blocks" in lines[2] and "hours" not in lines[2]
    assert script.blocks_path("flashspec", args) != script.blocks_path("flashspec", argparse.Namespace(
        **vars(args) | {"power": 8000}))


def test_empty_modules_stand_in_for_missing_packages_only():
    """``paths.empty_modules`` (what the benchmarks that run speculators' and vLLM's code use for packages their import
    chains name and the code run never calls): a missing package and its submodules import as empty modules whose
    attributes subclass (with keywords), subscript and call; an installed package is left alone."""
    import importlib
    import json
    import sys

    from specresearch.paths import empty_modules

    name, finders = "specresearch_no_such_package", list(sys.meta_path)
    try:
        assert empty_modules([name, "json"]) == [name]
        stand_in = importlib.import_module(f"{name}.models").Anything

        class Child(stand_in[int], flag=True):  # msgspec-style subclassing, typing-style subscripting
            pass

        assert Child(1, key=2) is not None and stand_in()() is None
        assert json.dumps([1]) == "[1]" and sys.modules["json"].__file__  # the real one
    finally:
        sys.meta_path[:] = finders
        for module in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[module]
