"""The command line speaks to people: user errors are one line on stderr and exit code 2, real bugs keep
their traceback, and every subcommand's --help shows a worked example."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from specresearch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = sorted(next(a for a in build_parser()._actions if a.dest == "command").choices)


def _user_error(capsys, argv: list[str], *needles: str) -> str:
    """Run ``specresearch <argv>``; it must exit 2 with exactly one stderr line naming the command."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"specresearch {argv[0]}: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def other_schema(tmp_path) -> Path:
    """A prompts file of another schema (Spec-Bench's question file uses question_id / turns)."""
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem."]}) + "\n")
    return path


def test_bench_prompts_file_of_another_schema_is_one_line_through_the_installed_entry_point(other_schema):
    proc = subprocess.run([sys.executable, "-m", "specresearch", "bench", "--prompts-file", str(other_schema)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"specresearch bench: error: --prompts-file {other_schema}: "), lines[0]
    assert "id, category and non-empty turns" in lines[0] and "data/README.md" in lines[0]
    assert proc.stdout == ""


def test_bench_missing_and_malformed_prompts_files(capsys, tmp_path):
    _user_error(capsys, ["bench", "--prompts-file", str(tmp_path / "nope.jsonl")], "nope.jsonl", "no such file")
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"id": "a", "category": "c", "turns": ["hi"]}\n{"id": "b", \n')
    _user_error(capsys, ["bench", "--prompts-file", str(malformed)], "line 2 is not JSON")
    not_objects = tmp_path / "list.jsonl"
    not_objects.write_text('["a", "b"]\n')
    _user_error(capsys, ["bench", "--prompts-file", str(not_objects)], "line 1 is list")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _user_error(capsys, ["bench", "--prompts-file", str(empty)], "holds no prompt")


def test_argparse_errors_are_one_line_too(capsys):
    _user_error(capsys, ["bench", "--gammas", "four"], "--gammas", "invalid int value")
    _user_error(capsys, ["generate", "hi", "--verifier", "tokn"], "--verifier", "invalid choice")
    _user_error(capsys, ["report", "--no-such-flag"], "unrecognized arguments")
    # an abbreviation is not a silent alias: --gamma is generate's flag, bench has --gammas
    _user_error(capsys, ["bench", "--gamma", "3"], "unrecognized arguments: --gamma 3")


def test_cuda_graph_modes_off_cuda_are_refused_before_a_model_loads(capsys, monkeypatch):
    import torch

    import specresearch.models.embedded as embedded

    monkeypatch.setattr(embedded, "load_embedded", lambda *a, **k: pytest.fail("a model loaded"))
    for command in (["generate", "hi", "--draft", "eagle3-v8k"], ["bench", "--draft", "v8k-4l"]):
        _user_error(capsys, [*command, "--compile", "cudagraph", "--device", "cpu"], "--compile cudagraph captures CUDA "
                    "graphs, and the run is on --device cpu", "--compile on", "--compile static")
    if not torch.cuda.is_available():  # where torch finds no CUDA device, auto and --device-map name that
        for extra in ([], ["--device-map", "auto"]):
            _user_error(capsys, ["generate", "hi", "--compile", "reduce-overhead", *extra], "--compile reduce-overhead "
                        "captures CUDA graphs, and torch sees no CUDA device on this machine")


@pytest.mark.slow
def test_compile_on_names_what_has_no_captured_step_and_a_captured_run_prints_its_figures(capsys):
    """``--compile on`` with a named lookup draft's length plan below gamma (decided per step on the host) or adaptive
    chains: one line, before any model loads, saying why and what runs it; generate's default draft, prompt lookup and
    the feature head run captured steps (eager here: ``--compile static``) and print the usual figures."""
    _user_error(capsys, ["generate", "hi", "--compile", "on", "--stop-below", "0.5"], "--compile on runs captured "
                "steps", "adaptive chains (--stop-below) decide on the host", "--draft eagle3-v8k", "--compile off")
    _user_error(capsys, ["generate", "hi", "--compile", "on", "--draft", "ngram+eagle3-v8k", "--gamma", "3"],
                "length plan (@draft-gamma=1", "ngram+eagle3-v8k@draft-gamma=none")
    for draft in ("fp16:eagle3-v8k", "ngram+fp16:eagle3-v8k", "ngram"):
        assert main(["generate", "hi", "--draft", draft, "--gamma", "2", "--compile", "static", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
        assert "gamma 2, block efficiency" in capsys.readouterr().out


def test_audit_engine_errors_and_a_run_with_its_record(capsys, tmp_path):
    _user_error(capsys, ["audit-engine", "transformers-assisted", "--option", "top_k"], "--option must be NAME=VALUE")
    _user_error(capsys, ["audit-engine", "transformers-assisted", "--option", "top_q=3"], "takes options")
    _user_error(capsys, ["audit-engine", "transformers-sampling", "--n-tokens", "2"], "n_tokens=1")
    record = tmp_path / "executed.jsonl"
    assert main(["audit-engine", "transformers-sampling", "--samples", "300", "--n-tokens", "1", "--record", str(record)]) == 0
    out = capsys.readouterr().out
    (row,) = [json.loads(line) for line in record.read_text().splitlines()]
    assert row["engine"] == "transformers-sampling" and row["num_samples"] == 300 and row["command"].startswith("specresearch")
    assert row["finding"] in out and sum(row["counts"]) == 300


def test_report_user_errors(capsys, tmp_path):
    _user_error(capsys, ["report", "--only", "99_nothing", "--out", str(tmp_path)], "matches no notebook")
    _user_error(capsys, ["report", "--notebooks", str(tmp_path / "missing")], "does not exist")


def test_warm_cache_unknown_model(capsys):
    _user_error(capsys, ["warm-cache", "--model", "gpt-17"], "gpt-17", "smollm2-135m-instruct")


def test_distill_user_errors_fail_before_loading_anything(capsys, tmp_path):
    _user_error(capsys, ["distill", "--prompts", str(tmp_path / "p.jsonl")], "--prompts", "no such file")
    _user_error(capsys, ["distill", "--preset", "v8k-3l"], "v8k-3l")
    _user_error(capsys, ["distill", "--steps", "0"], "steps")
    _user_error(capsys, ["feature-distill", "--chunks", "0", "--collect-only"], "--chunks must be >= 1")
    _user_error(capsys, ["feature-distill", "--save-tokens"], "--save-tokens goes with --collect-only")
    _user_error(capsys, ["feature-distill", "--first-chunk", "-1"], "--first-chunk must be >= 0")
    _user_error(capsys, ["feature-distill", "--collect-only", "--save-tokens", "--first-chunk", "100000"],
                "committed ids hold the", "drop --first-chunk")
    _user_error(capsys, ["feature-distill", "--collect-only", "--init-from", "eagle3-v8k"], "--init-from goes with training")
    _user_error(capsys, ["feature-distill", "--init-from", str(tmp_path)], "no feature head in")
    _user_error(capsys, ["feature-distill", "--preset", "eagle9"], "eagle9")


@pytest.mark.slow
def test_generate_unknown_draft_and_model_names(capsys, tmp_path):
    line = _user_error(capsys, ["generate", "hi", "--draft", "v9-nope", "--max-new-tokens", "2"], "--draft 'v9-nope'")
    assert "ngram" in line and "truncated:N" in line and "v8k-4l" in line
    _user_error(capsys, ["generate", "hi", "--model", str(tmp_path / "no-model")], "--model", "no-model")
    _user_error(capsys, ["generate", "hi", "--gamma", "0", "--max-new-tokens", "2", "--draft", "ngram"], "gamma")



def test_generate_refuses_a_prompt_its_model_cannot_read_before_loading_a_draft(capsys, monkeypatch, tmp_path):
    """A checkpoint whose logits are smaller than its tokenizer (a random-weight Qwen2 of 64 tokens saved with the
    embedded tokenizer): the engine's one-line error, before a draft loads or this machine's step costs are timed."""
    from transformers import AutoTokenizer

    import specresearch.drafts.registry as drafts
    from specresearch.models.embedded import cache_dir, load_embedded
    from specresearch.models.families import tiny_family_model

    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
        load_embedded(device="cpu")  # converts the GGUF once (the tokenizer comes with it)
    AutoTokenizer.from_pretrained(cache_dir() / "smollm2-135m-instruct", local_files_only=True).save_pretrained(tmp_path)
    tiny_family_model("qwen2", "sdpa").save_pretrained(tmp_path)
    capsys.readouterr()  # the save's progress bar
    monkeypatch.setattr(drafts, "draft_from_name", lambda *args, **kwargs: pytest.fail("a draft loaded first"))
    _user_error(capsys, ["generate", "hi", "--model", str(tmp_path)], "prompt token ids must be in [0, vocab_size=64)")


def test_a_checkpoint_without_its_tokenizer_or_with_another_targets_draft_is_named(capsys, tmp_path):
    """Weights saved without a tokenizer (transformers' own error named a tokenizer backend), and a checkpoint the
    default draft was not trained for (a random-weight Llama with the embedded vocabulary): one line each, saying what
    to save or which drafts serve it; prompt lookup then decodes it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specresearch.models.embedded import cache_dir, load_embedded

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    capsys.readouterr()
    _user_error(capsys, ["generate", "hi", "--model", str(tmp_path)], f"{tmp_path} holds a model but no tokenizer",
                f"tokenizer.save_pretrained('{tmp_path}')")
    assert main(["generate", "hi", "--draft", str(tmp_path)]) == 2  # as a draft: after the target (and its calibration)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"specresearch generate: error: {tmp_path} "
                                                                       "holds a model but no tokenizer")
    if not (cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
        load_embedded(device="cpu")
    AutoTokenizer.from_pretrained(cache_dir() / "smollm2-135m-instruct", local_files_only=True).save_pretrained(tmp_path)
    capsys.readouterr()
    for draft in ([], ["--draft", "v8k-4l"]):
        _user_error(capsys, ["generate", "hi", "--model", str(tmp_path), *draft], "was trained for another target "
                    "(hidden size 576, vocabulary 49152; this target's: 32, 49152)", "prompt lookup ('ngram')")
    assert main(["generate", "hi", "--model", str(tmp_path), "--draft", "ngram", "--max-new-tokens", "3"]) == 0

@pytest.mark.slow
def test_generate_drafts_with_the_combined_draft_by_default(capsys, monkeypatch, brief_cost_timing):
    """``generate`` without --draft uses GENERATE_DRAFT (its greedy text equals --autoregressive's), and
    --method contrastive uses CONTRASTIVE_AMATEUR as the amateur."""
    import specresearch.drafts.registry as drafts
    import specresearch.engine.cost as cost
    from specresearch.cli import CONTRASTIVE_AMATEUR, GENERATE_DRAFT

    names, made, real = [], [], drafts.draft_from_name
    monkeypatch.setattr(drafts, "draft_from_name", lambda name, *a, **k: names.append(name) or made.append(
        real(name, *a, **k)) or made[-1])
    texts = []
    for extra in ([], ["--autoregressive"]):
        assert main(["generate", "Name three rivers.", "--max-new-tokens", "12", "--temperature", "0", *extra]) == 0
        texts.append(capsys.readouterr().out.split("\n\n12 tokens in ")[0])
    assert texts[0] == texts[1] and len(texts[0]) > 10
    assert main(["generate", "Name three rivers.", "--max-new-tokens", "3", "--method", "contrastive"]) == 0
    assert names[0] == GENERATE_DRAFT and names[-1] == CONTRASTIVE_AMATEUR  # (the combined draft loads its head in between)
    # a tree this machine's costs would pick runs as such (greedy: the same text), trees weighed for the default draft only
    asked, real_resolve = [], cost.resolve_config
    capsys.readouterr()
    monkeypatch.setattr(cost, "resolve_config", lambda gamma, target, draft, **kwargs: asked.append(kwargs["trees"]) or
                        cost.tree_options((2, 2, 3)))
    assert main(["generate", "Name three rivers.", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    text, summary = capsys.readouterr().out.split("\n\n12 tokens in ")
    assert text == texts[0] and "; onehot tree K 2, depth 2, 3 nodes, block efficiency" in summary
    assert main(["generate", "Name three rivers.", "--max-new-tokens", "2", "--draft", "ngram"]) == 0
    assert asked == [True, False]
    # a chain the machine picks is the default draft's length off a lookup match too (named or not: as
    # specresearch.generate and bench take it); another combined draft keeps its own
    other = "ngram+eagle3-v8k"
    monkeypatch.setattr(cost, "resolve_config", lambda gamma, target, draft, **kwargs: {"gamma": 2})
    for named in ([], ["--draft", GENERATE_DRAFT]):
        assert main(["generate", "Name three rivers.", "--max-new-tokens", "4", "--temperature", "0", *named]) == 0
        assert made[-1].draft_gamma == 2
    assert main(["generate", "Name three rivers.", "--max-new-tokens", "4", "--draft", other]) == 0
    assert made[-1].draft_gamma == 1
    monkeypatch.setattr(cost, "resolve_config", real_resolve)  # a gamma given is the off-match length too
    capsys.readouterr()
    for named in ([], ["--draft", GENERATE_DRAFT]):
        assert main(["generate", "Name three rivers.", "--max-new-tokens", "4", "--gamma", "3", *named]) == 0
        assert made[-1].draft_gamma == 3 and "; gamma 3, block efficiency" in capsys.readouterr().out
    assert main(["generate", "Name three rivers.", "--max-new-tokens", "4", "--gamma", "3", "--draft", other]) == 0
    assert made[-1].draft_gamma == 1


@pytest.mark.slow
def test_bench_unknown_draft_and_category(capsys, tmp_path):
    _user_error(capsys, ["bench", "--draft", "v9-nope", "--out", str(tmp_path)], "--draft 'v9-nope'")
    _user_error(capsys, ["bench", "--draft", "ngram", "--categories", "poetry", "--out", str(tmp_path)],
                "poetry", "not in the prompt set")


@pytest.mark.slow
def test_a_real_bug_keeps_its_traceback(tmp_path):
    """A notebook whose cell raises is a failure of the code, not of the command line: it propagates."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise ValueError('a bug inside the notebook')")]
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / "01_broken.ipynb")
    with pytest.raises(CellExecutionError, match="a bug inside the notebook"):
        main(["report", "--notebooks", str(tmp_path / "nb"), "--out", str(tmp_path / "out"), "--quick"])


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_shows_a_worked_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    example = out.split("example:\n", 1)[1]
    assert f"specresearch {command}" in example
    first = shlex.split(example.splitlines()[0], comments=True)
    assert first[:2] == ["specresearch", command]
    assert build_parser().parse_args(first[1:]).command == command


def test_there_are_subcommands():
    assert {"report", "generate", "distill", "warm-cache", "bench"} <= set(SUBCOMMANDS)


def _refuse_model_loads(monkeypatch) -> None:
    """Make every way to load an embedded model raise. The modules that bind the loaders by name are imported first,
    so that none binds the refusing stand-in for good (monkeypatch restores what it set, not what an import took)."""
    import specresearch.drafts.registry as registry
    import specresearch.models.embedded as embedded

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    for module, name in ((embedded, "load_model"), (embedded, "load_embedded"), (registry, "load_embedded")):
        monkeypatch.setattr(module, name, refuse)


def test_a_top_k_tree_is_verified_by_its_one_rule_unless_another_is_named():
    """``--draft-law dynamic`` / ``static`` without ``--verifier``: onehot, the only rule their trees take (a named
    other rule is refused, below); a chain's default stays block."""
    from specresearch.cli import build_parser
    from specresearch.cli_checks import check_generate_flags

    for extra, want in ((["--draft-law", "dynamic", "--num-drafts", "3"], "onehot"), (["--draft-law", "static"], "onehot"),
                        ([], "block"), (["--num-drafts", "2", "--verifier", "traversal"], "traversal")):
        args = build_parser().parse_args(["generate", "hi", *extra])
        args.gamma_given, args.verifier_given, args.gamma = False, args.verifier is not None, 3
        check_generate_flags(args)
        assert args.verifier == want, extra


@pytest.mark.parametrize("argv, needle", [
    (["generate", "hi", "--device", "foo"], "--device 'foo' is not a device"),
    (["generate", "hi", "--device", "cuda:0"], "no CUDA device"),
    (["generate", "hi", "--device", "mps"], "no Apple GPU"),
    (["generate", "hi", "--threads", "-3"], "--threads must be >= 1"),
    (["generate", "hi", "--threads", "0"], "--threads must be >= 1"),
    (["generate", "hi", "--gamma", "0"], "--gamma must be >= 1"),
    (["generate", "hi", "--gamma", "fast"], "--gamma must be a count >= 1 or 'auto'"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "hi", "--draft", "v9-nope"], "--draft 'v9-nope' is neither a known name"),
    (["generate", "hi", "--draft", "mtp"], "the embedded models have none"),
    (["generate", "hi", "--draft", "fp16:mtp"], "the embedded models have none"),
    (["generate", "  "], "the prompt is empty"),
    (["generate", "hi", "--method", "beam", "--verifier", "token"], "--method beam decodes without a draft"),
    (["generate", "hi", "--method", "beam", "--gamma", "3"], "--method beam decodes without a draft"),
    (["generate", "hi", "--num-drafts", "3"], "choose a multi-draft --verifier"),
    (["generate", "hi", "--num-drafts", "3", "--verifier", "traversal", "--draft-law", "dynamic"], "with --verifier onehot"),
    (["generate", "hi", "--tree-nodes", "8"], "--tree-nodes is a count >= 1 for --draft-law dynamic"),
    (["generate", "hi", "--verifier", "onehot", "--draft-law", "dynamic", "--tree-nodes", "0"], "--tree-nodes is a count"),
])
def test_generate_flag_errors_come_before_any_model_loads(capsys, monkeypatch, argv, needle):
    _refuse_model_loads(monkeypatch)
    if "cuda" in argv[-1] or "mps" in argv[-1]:
        import torch

        if torch.cuda.is_available() or (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            pytest.skip("this machine has the device, so the flag is valid here")  # the CPU CI always runs these
    _user_error(capsys, argv, needle)


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--device", "foo"], "--device 'foo' is not a device"),
    (["bench", "--draft", "v9-nope"], "--draft 'v9-nope' is neither a known name"),
    (["bench", "--target", "HuggingFaceTB/SmolLM2-360M"], "allow downloads: HF_HUB_OFFLINE=0"),
    (["distill", "--threads", "-1"], "--threads must be >= 1"),
    (["distill", "--target", "foo"], "this command works on an embedded model"),
    (["feature-distill", "--target", "foo"], "this command works on an embedded model"),
    (["generate", "hi", "--model", "HuggingFaceTB/SmolLM2-360M"], "allow downloads: HF_HUB_OFFLINE=0"),
    (["generate", "hi", "--model", "{tmp}"], "without config.json is not a transformers checkpoint"),
    (["generate", "hi", "--draft", "{tmp}"], "holds no draft layout this toolkit reads"),
    (["bench", "--draft", "{tmp}"], "holds no draft layout this toolkit reads"),
])
def test_shared_flag_errors_of_every_command_come_before_any_model_loads(capsys, monkeypatch, tmp_path, argv, needle):
    _refuse_model_loads(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _user_error(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv], needle)


def test_draft_mtp_needs_a_checkpoint_announcing_mtp_layers_before_any_model_loads(capsys, monkeypatch, tmp_path):
    import json

    _refuse_model_loads(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _user_error(capsys, ["generate", "hi", "--model", str(tmp_path), "--draft", "mtp"], "announces no MTP layers")


def test_a_hub_name_goes_through_when_downloads_are_allowed(monkeypatch):
    from specresearch.cli_checks import check_model_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_model_name("--model", "HuggingFaceTB/SmolLM2-360M")  # transformers resolves (or refuses) it


def test_lab_script_adds_allow_root_only_as_root():
    import os

    out = subprocess.run(["bash", str(ROOT / "scripts" / "lab.sh"), "--no-browser"], capture_output=True, text=True,
                         env={**os.environ, "SPECRESEARCH_LAB_ECHO": "1"}, check=True)
    assert out.stdout.startswith("jupyter lab ") and "--no-browser" in out.stdout
    assert ("--allow-root" in out.stdout) == (os.getuid() == 0) == ("running as root" in out.stderr)


def test_bench_default_config_times_what_generate_runs(capsys, monkeypatch, tmp_path):
    """``bench --default-config`` runs generate's own draft, verifier and gamma (the one this machine picks,
    ``run_named(default_gamma=True)``), and refuses flags that change them."""
    from specresearch.config import GENERATE_DRAFT, GENERATE_GAMMA
    from specresearch.experiments import analysis, bench

    seen = {}

    def fake_run(target, draft, config, path, **kwargs):
        seen.update(draft=draft, verifiers=config.verifiers, gammas=config.gammas, temperatures=config.temperatures,
                    machine_gamma=kwargs["default_gamma"])
        kwargs["announce"]("timing")  # the CLI prints what run_named says while it times the machine
        return []

    monkeypatch.setattr(bench, "run_named", fake_run)
    monkeypatch.setattr(analysis, "summary", lambda records: "")
    monkeypatch.setattr(analysis, "t0_agreement", lambda records: (0, 0))
    assert main(["bench", "--default-config", "--temperatures", "0", "1", "--out", str(tmp_path)]) == 0
    assert seen == {"draft": GENERATE_DRAFT, "verifiers": ("block",), "gammas": (GENERATE_GAMMA,), "temperatures": (0.0, 1.0),
                    "machine_gamma": True}
    assert "timing\n" in capsys.readouterr().err
    _user_error(capsys, ["bench", "--default-config", "--gammas", "3"], "--default-config fixes", "--gammas")


def test_bench_default_config_runs_the_choice_at_each_temperature(monkeypatch, tmp_path):
    """``run_named(default_gamma=True)``: at each temperature what ``engine.cost.default_config`` picks for generate's
    draft (trees weighed), a dynamic tree as bench's ``onehot:K:dynamic:N`` at its depth; the run's description keeps
    the choices."""
    import json

    import specresearch.engine.cost as cost
    import specresearch.models.embedded as embedded
    from specresearch.config import GENERATE_DRAFT
    from specresearch.experiments import bench

    class Tokenizer:
        eos_token_id = 0

    class Combined:  # as generate's default draft: one token off a lookup match unless a chain says otherwise
        draft_gamma = 1

    ran, asked, draft = [], [], Combined()
    monkeypatch.setattr(embedded, "load_model", lambda name, device: ("target", Tokenizer()))
    monkeypatch.setattr(bench, "load_bench_draft", lambda name, target: draft)
    monkeypatch.setattr(bench, "load_bench_prompts", lambda tokenizer, config, path: [])
    monkeypatch.setattr(cost, "default_config", lambda target, draft, temperature, trees, announce: asked.append(
        (trees, announce)) or (cost.tree_options((8, 6, 32)) if temperature == 0 else {"gamma": 2}))
    monkeypatch.setattr(bench, "run_bench", lambda target, draft, prompts, config, path, **kwargs: ran.append(
        (config.temperatures, config.verifiers, config.gammas, draft.draft_gamma)) or [])
    config = bench.BenchConfig(verifiers=("block",), temperatures=(0.0, 1.0), gammas=(1,))
    bench.run_named("smollm2-135m-instruct", GENERATE_DRAFT, config, tmp_path / "run.csv", default_gamma=True,
                    announce=print)
    # the chain's length is the combined draft's off-match length too (engine.cost.fit_default_draft); a tree keeps it
    assert ran == [((0.0,), ("onehot:8:dynamic:32",), (6,), 1), ((1.0,), ("block",), (2,), 2)]
    assert asked == [(True, print), (True, print)]  # trees weighed; told what to say while timing
    info = json.loads((tmp_path / "run.json").read_text())[-1]
    assert [(c["verifiers"], c["gammas"]) for c in info["chosen"]] == [(["onehot:8:dynamic:32"], [6]), (["block"], [2])]


def test_generate_dtype_sets_the_targets_arithmetic_and_a_checkpoint_draft_follows(capsys, monkeypatch, tmp_path):
    """``--dtype``: ``auto`` keeps a checkpoint's dtype (bfloat16 here, as transformers loads it), ``float32`` loads it
    in float32 (the arithmetic in which greedy speculative decoding keeps autoregressive decoding's tokens on a CPU);
    a checkpoint draft (saved in float32) computes in the target's dtype."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import specresearch.drafts.registry as drafts
    import specresearch.models.embedded as embedded

    if not (embedded.cache_dir() / "smollm2-135m-instruct" / "config.json").exists():
        embedded.load_embedded(device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(embedded.cache_dir() / "smollm2-135m-instruct", local_files_only=True)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    for name, dtype in (("target", torch.bfloat16), ("draft", torch.float32)):
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(dtype).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    loaded, load_model, draft_from_name = [], embedded.load_model, drafts.draft_from_name
    monkeypatch.setattr(embedded, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)[0]) or
                        (loaded[-1], tokenizer))
    monkeypatch.setattr(drafts, "draft_from_name", lambda *a, **k: loaded.append(draft_from_name(*a, **k)) or loaded[-1])
    capsys.readouterr()
    for flag, dtype in (("auto", torch.bfloat16), ("float32", torch.float32)):
        assert main(["generate", "hi", "--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                     "--dtype", flag, "--max-new-tokens", "3", "--temperature", "0"]) == 0
        assert [lm.model.dtype for lm in loaded[-2:]] == [dtype, dtype], flag
    capsys.readouterr()
    _user_error(capsys, ["generate", "hi", "--dtype", "float64"], "invalid choice: 'float64'")
