"""PyPI libraries that claim lossless speculative decoding of transformers models, run on the embedded pair: the law of
their first generated tokens against the target's (``specresearch.audit.execute``, engine ``python``).

Each library is downloaded from the package index as it is published (``pip download --no-deps``), unpacked into a
folder of its own under the cache and imported from there by a worker process of its own (nothing installed into
the project's environment; a library whose pins fight ours still runs on the versions here, or says why it does not).
Each runs on SmolLM2-135M-Instruct (float32, CPU) with the shipped distilled draft ``v8k-4l`` as its draft model, at
temperature ``--temperature``, its own defaults otherwise (gamma where it asks for one: ``--gamma``). A library that
will not run gets one line saying why.

    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --out benchmarks/records/audit_libraries.json
    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --smallest seqspecdecod.capped_hsd --samples 3000
    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --power 22000 --only specdec   # beside another library
    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --power 22000 --only economize --executor ray --workers 2
    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --power 22000 --status
    PYTHONPATH=. .venv/bin/python benchmarks/audit_libraries.py --base-law eagle-llm   # its own model's law, exactly

Resumable: libraries already in the record are kept. ``--smallest NAME`` adds, for a library with a finding, the
smallest input that shows it (a 64-token random pair, gamma 1 to 3) under ``smallest_inputs``. ``--power N`` runs
the libraries at N (22,000 at T = 1 detects TV 0.030 on cells of expected count >= ``--min-expected`` 50, as
``benchmarks/audit_executed.py``'s power runs) as seed blocks of ``--batch-size``, each stored in
``benchmarks/records/blocks/`` as it lands, so that a run of hours resumes where it stopped; two processes with
``--only`` run two libraries side by side and share the record; ``--executor ray`` runs one library's blocks as Ray
tasks (``--workers`` CPUs here, or ``--address`` a cluster), each worker building the library's sampler once
(``library_sampler``): the blocks, and so the counts, are those a local run draws; ``--status`` prints each library's
blocks so far. ``--base-law NAME`` computes, for a library that samples a base model of its own build (eagle-llm's
Llama), that model's law on the prompt against the target's exactly, with its own forward, under ``base_models``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from specresearch.paths import pypi_wheel

# name -> (PyPI distribution and version, import name, what runs)
LIBRARIES = {
    "specdec": ("specdec==0.2.0", "specdec", "SpecDecoder.generate_small + verify (Leviathan et al.'s loop)"),
    "seqspecdecod.standard": ("sequential-speculative-decoding==0.1.1", "seqspecdecod", "standard_speculative_step"),
    "seqspecdecod.naive_hsd": ("sequential-speculative-decoding==0.1.1", "seqspecdecod", "naive_hsd_step (hierarchical SD)"),
    "seqspecdecod.capped_hsd": ("sequential-speculative-decoding==0.1.1", "seqspecdecod", "capped_hsd_step (hierarchical SD)"),
    "flashspec": ("flashspec==0.3.1", "flashspec", "SpeculativeEngine.generate, its default strategy"),
    "eagle-llm": ("eagle-llm==1.2.1", "eagle", "EaModel.eagenerate (EAGLE-1/2), as shipped"),
    "eagle-llm.rope_theta": ("eagle-llm==1.2.1", "eagle", "EaModel.eagenerate (EAGLE-1/2), its RoPE given the config's base"),
    "economize": ("economize==0.3.2", "economize", "economize.generate with a speculative technique"),
}
BLOCKS = Path("benchmarks/records/blocks")


def pair():
    """The embedded target and the shipped ``v8k-4l`` as the toolkit's wrappers, and the tokenizer: a recipe
    (``experiments.executor.loaded``), built once a process."""
    from specresearch.drafts.registry import load_pair

    return load_pair(draft="v8k-4l", device="cpu", skinny_linear=False, fuse_projections=False)


def library_sampler(name: str, temperature: float, gamma: int):
    """Library ``name``'s sampler on the embedded pair, its folder first on ``sys.path``: a recipe (``loaded``) for the
    workers of ``--executor ray``, which build it once each (a sampler holds the library's models and does not
    travel)."""
    folder = str(pypi_wheel(LIBRARIES[name][0]))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from specresearch.experiments.executor import loaded

    target, draft, tokenizer = loaded(pair)
    return sampler(name, target, draft, temperature, gamma, tokenizer)


def blocks_path(name: str, args) -> Path:
    """Where library ``name``'s power run at ``args``' settings stores its seed blocks."""
    text = json.dumps([name, LIBRARIES[name][0], args.prompt, args.n_tokens, args.temperature, args.gamma, args.power,
                       args.batch_size])
    return BLOCKS / f"library-{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"


def done_key(row: dict) -> tuple:
    """A record row's library and, for a power run, its N."""
    return row["library"], row.get("power_n")


def sampler(name: str, target_lm, draft_lm, temperature: float, gamma: int, tokenizer=None):
    """``sample(prompt_ids, n_tokens) -> token ids`` running library ``name``'s own code (``target_lm`` / ``draft_lm``:
    the toolkit's wrappers; the libraries get the transformers models inside; ``tokenizer``: the target's, for a
    library that loads one from the model's folder)."""
    import torch

    target, draft = target_lm.model, draft_lm.model
    if name == "specdec":
        from specdec.decoder import SpecDecoder

        decoder = object.__new__(SpecDecoder)  # its __init__ loads models by hub name; the same attributes, set here
        decoder.small_model, decoder.big_model, decoder.device = draft, target, "cpu"
        if temperature != 1.0:
            raise ValueError("specdec samples at temperature 1 only (softmax of the raw logits)")

        def sample(prompt, n_tokens):
            ids, out = torch.tensor([prompt]), []
            while len(out) < n_tokens:
                tokens, laws = decoder.generate_small(ids, gamma)
                kept = decoder.verify(ids, tokens, laws)
                out += kept
                ids = torch.cat([ids, torch.tensor([kept])], 1)
            return out
        return sample
    if name.startswith("seqspecdecod."):
        import seqspecdecod.capped_hsd
        import seqspecdecod.naive_hsd
        import seqspecdecod.standard_sd

        step = {"standard": seqspecdecod.standard_sd.standard_speculative_step,
                "naive_hsd": seqspecdecod.naive_hsd.naive_hsd_step,
                "capped_hsd": seqspecdecod.capped_hsd.capped_hsd_step}[name.split(".")[1]]

        def sample(prompt, n_tokens):
            ids = torch.tensor([prompt])
            while ids.shape[1] - len(prompt) < n_tokens:
                ids = step(draft, target, ids, gamma=gamma, draft_temperature=temperature,
                           target_temperature=temperature)[0]
            return ids[0, len(prompt):].tolist()
        return sample
    if name == "flashspec":
        from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine
        from flashspec.engine.hf_drafter import HuggingFaceDrafter
        from flashspec.engine.verifier import TargetModel

        config = FlashSpecConfig(drafter_name="v8k-4l", target_name="smollm2-135m-instruct", device="cpu",
                                 dtype="float32", compile=False,
                                 sampling=SamplingConfig(gamma=gamma, temperature=temperature, top_p=1.0))
        engine = SpeculativeEngine(config, [HuggingFaceDrafter("v8k-4l", "cpu", temperature=temperature, model=draft)],
                                   TargetModel("smollm2-135m-instruct", torch.device("cpu"), torch.float32, model=target))

        def sample(prompt, n_tokens):
            result = engine.generate(torch.tensor([prompt]), max_new_tokens=n_tokens + 1)
            return [t for t in result.output_ids[0].tolist() if t >= 0]
        return sample
    if name.startswith("eagle-llm"):
        return _eagle_llm(target, temperature, tokenizer, rope_theta=name.endswith(".rope_theta"))
    if name == "economize":
        import copy
        import tempfile

        import economize

        from specresearch.drafts.registry import truncated_draft

        folder = Path(tempfile.mkdtemp(prefix="economize-draft-"))
        truncated_draft(target_lm, 6).model.save_pretrained(folder)  # a plain causal LM directory, as it loads drafts
        from economize.techniques.draft_model import DraftModelConfig

        model = economize.apply(copy.deepcopy(target), DraftModelConfig(model=str(folder), dtype="float32"))
        # its sampler draws from a private generator seeded per call: the seeds come from torch's global generator,
        # which execute() seeds (per seed block with an executor), so a resumed run draws new generations
        next_seed = lambda: int(torch.randint(2**62, ()))  # noqa: E731

        def sample(prompt, n_tokens):
            result = model.decode(torch.tensor(prompt), n_tokens + 1,
                                  decoding=economize.DecodeConfig(cycle_length=gamma + 1, verifier="rejection"),
                                  selector=economize.TopPSampler(temperature=temperature, top_p=1.0, seed=next_seed()))
            return result.tokens.tolist()
        return sample
    raise ValueError(f"unknown library {name!r}")


def _eagle_llm(target, temperature: float, tokenizer, rope_theta: bool):
    """eagle-llm's EaModel on the embedded target with a randomly initialised EAGLE-1 head in its own format (the
    head's quality changes the speed, not the law its verification promises), its tokenizer beside the base's weights
    (EaModel loads it for the end-of-sequence id).

    eagle-llm 1.2.1 was written for transformers 4.x; four shims let it run on 5.x without touching what it computes:
    its tied head named as a 4.x list (``["lm_head.weight"]``) is named as 5.x's map to the embedding, transformers 5's
    configs report plain RoPE as ``rope_scaling = {"rope_type": "default", ...}`` where 4.x had
    ``None`` (its ``_init_rope`` reads ``["type"]``: set to ``None`` there), 5.x's loading leaves the rotary
    embeddings' non-persistent buffers unset (NaN logits: they are rebuilt, ``_init_rope`` again, after loading),
    and the model is put in eval mode as its README does (its head runs the training branch otherwise, which returns
    no cache). Its own Llama (``modeling_llama_kv``, and the head's ``cnets``) builds RoPE with base 10,000 whatever
    the config's ``rope_theta`` (SmolLM2's is 100,000): ``rope_theta=True`` (library ``eagle-llm.rope_theta``)
    gives its rotary embeddings the config's base, to test its verification apart from that."""
    if tokenizer is None:
        raise ValueError("eagle-llm's EaModel loads a tokenizer from the base model's folder: pass the target's")
    import tempfile

    import torch
    from eagle.model import cnets, modeling_llama_kv
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    from eagle.model.ea_model import EaModel

    def plain_rope(init_rope):
        def init(self):
            scaling = self.config.rope_scaling
            if isinstance(scaling, dict) and scaling.get("rope_type") == "default":
                self.config.rope_scaling = None
            init_rope(self)
        init.shimmed = True
        return init

    modeling_llama_kv.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    for module in (cnets, modeling_llama_kv):
        if not getattr(module.LlamaAttention._init_rope, "shimmed", False):
            module.LlamaAttention._init_rope = plain_rope(module.LlamaAttention._init_rope)
    base = Path(tempfile.mkdtemp(prefix="eagle-base-"))
    target.save_pretrained(base)
    tokenizer.save_pretrained(base)
    head = Path(tempfile.mkdtemp(prefix="eagle-head-"))
    (head / "config.json").write_text((base / "config.json").read_text())
    torch.manual_seed(0)
    torch.save(Model(EConfig.from_pretrained(head / "config.json"), load_emb=False).state_dict(),
               head / "pytorch_model.bin")
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), torch_dtype=torch.float32)
    for module in model.modules():
        if hasattr(module, "rotary_emb"):
            module._init_rope()  # the buffers 5.x's loading left unset
            if rope_theta:
                module.rotary_emb = type(module.rotary_emb)(module.head_dim, module.max_position_embeddings,
                                                            base=target.config.rope_parameters["rope_theta"])
    model.eval()

    def sample(prompt, n_tokens):
        ids = torch.tensor([prompt])
        return model.eagenerate(ids, temperature=temperature, max_new_tokens=n_tokens + 1)[0, len(prompt):].tolist()
    sample.model = model  # base_law reads its base model
    return sample


def worker(name: str, args) -> dict:
    """Run one library in this (fresh) process: its folder first on ``sys.path``."""
    spec, module, what = LIBRARIES[name]
    sys.path.insert(0, str(pypi_wheel(spec)))
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks import audit_libraries as this  # the recipes by their module's name, here and in Ray's workers
    from specresearch.audit.execute import execute
    from specresearch.experiments.executor import LocalExecutor, loaded, make_executor
    from specresearch.experiments.records import git_commit

    target, draft, tokenizer = loaded(this.pair)
    executor = None if args.power is None else make_executor(args, local=LocalExecutor)
    power = {} if args.power is None else dict(
        num_samples=args.power, min_expected=args.min_expected, executor=executor, models=this.pair,
        batch_size=args.batch_size, blocks_file=blocks_path(name, args))

    row = {"library": name, "distribution": spec, "runs": what, "temperature": args.temperature, "gamma": args.gamma,
           "commit": git_commit()}
    try:
        if power and executor.name != "local":
            library = dict(sampler=functools.partial(this.library_sampler, name, args.temperature, args.gamma))
        else:
            library = dict(sample=sampler(name, target, draft, args.temperature, args.gamma, tokenizer))
        result = execute("python", prompt=args.prompt, n_tokens=args.n_tokens, **({"num_samples": args.samples} | power),
                         temperature=args.temperature, target=target.model, tokenizer=tokenizer, **library,
                         name=name, version=spec, progress=False)
    except Exception as error:  # a library that does not run here: one line saying why
        return row | {"ran": False, "why": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    print(result, flush=True)
    extra = {} if args.power is None else {"power_n": args.power, "batch_size": args.batch_size,
                                           "min_expected": args.min_expected, "executor": executor.name}
    return row | {"ran": True, "prompt": args.prompt} | result.as_record() | extra


def smallest(name: str, args) -> dict:
    """The smallest input that shows a library's finding: a 64-token random pair (``models.families``' tiny Llama and
    a perturbed copy as its draft), one token, gamma 1 to 3 (``--samples`` each, seed 0)."""
    spec = LIBRARIES[name][0]
    sys.path.insert(0, str(pypi_wheel(spec)))
    from specresearch.audit.execute import execute
    from specresearch.models.causal_lm import CausalLM
    from specresearch.models.families import perturbed_copy, tiny_family_model

    target = tiny_family_model("llama", "sdpa", seed=0, init_std=0.5)
    draft = perturbed_copy(target, noise=1.0, seed=3)

    def wrap(model):  # what sampler() unwraps: the model as transformers built it
        return CausalLM(model, device="cpu", skinny_linear=False, fuse_projections=False)

    rows = {}
    for gamma in (1, 2, 3):
        sample = sampler(name, wrap(target), wrap(draft), 1.0, gamma)
        result = execute("python", prompt=[5, 9, 17, 3, 5, 9], n_tokens=1, num_samples=args.samples, target=target,
                         sample=sample, name=name, version=spec, progress=False)
        rows[f"gamma {gamma}"] = {"p_value": result.target.p_value, "tv": result.target.tv,
                                  "tv_floor": result.target.tv_floor, "finding": result.finding}
        print(name, f"gamma {gamma}:", rows[f"gamma {gamma}"], flush=True)
    return {"library": name, "input": "tiny Llama (64 tokens, seed 0) and a perturbed copy (noise 1.0, seed 3) as draft; "
            "prompt [5, 9, 17, 3, 5, 9]; the first token, T = 1", "num_samples": args.samples, "by_gamma": rows}


def base_law(name: str, args) -> dict:
    """For a library that samples from a base model of its own build (eagle-llm's Llama): that model's law on
    ``--prompt`` against the target's, exactly (its own forward, no sampling): TV of the first token, and of the first
    two over the first tokens the target gives probability > 1e-5 (with the mass they cover)."""
    spec = LIBRARIES[name][0]
    sys.path.insert(0, str(pypi_wheel(spec)))
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks import audit_libraries as this
    from specresearch.engine.prompts import encode_chat
    from specresearch.experiments.executor import loaded

    target, _, tokenizer = loaded(this.pair)
    if not name.startswith("eagle-llm"):
        raise ValueError(f"{name} samples from the target it is given: no base model of its own")
    model = _eagle_llm(target.model, args.temperature, tokenizer, rope_theta=name.endswith(".rope_theta")).model
    ids = encode_chat([args.prompt], tokenizer)[0].tolist()  # as execute() templates a string prompt
    with torch.no_grad():
        want = target.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    top = torch.nonzero((want / args.temperature).softmax(-1) > 1e-5).flatten()  # the first tokens the two-token law sums

    def laws(forward):
        with torch.no_grad():
            first = (forward(torch.tensor([ids]))[0, -1].float() / args.temperature).softmax(-1)
            second = (forward(torch.tensor([ids + [int(t)] for t in top]))[:, -1].float() / args.temperature).softmax(-1)
        return first, first[top, None] * second

    own_first, own_two = laws(lambda x: _logits(model.base_model(input_ids=x)))
    want_first, want_two = laws(lambda x: target.model(input_ids=x).logits)
    return {"library": name, "prompt": args.prompt, "temperature": args.temperature,
            "first_token_tv": 0.5 * (own_first - want_first).abs().sum().item(),
            "two_token_tv": 0.5 * (own_two - want_two).abs().sum().item(),
            "first_tokens": len(top), "mass_covered": want_first[top].sum().item()}


def _logits(output):
    return output[0] if isinstance(output, tuple) else output.logits


def _in_worker(worker: str, flags: list[str]) -> tuple[dict | None, str]:
    """Run ``--worker worker`` in a fresh process of this script. -> (its result, or None and why it gave none)."""
    done = subprocess.run([sys.executable, __file__, f"--worker={worker}", *flags], capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT "):]), ""
    return None, f"its worker exited with {done.returncode}: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/records/audit_libraries.json")
    parser.add_argument("--only", nargs="*", help="these libraries (default: all)")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--n-tokens", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gamma", type=int, default=2)
    parser.add_argument("--prompt", default="Name a colour.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smallest", help="a library with a finding: the smallest input that shows it, into the record")
    parser.add_argument("--base-law", choices=[name for name in LIBRARIES if name.startswith("eagle-llm")],
                        help="a library with a base model of its own (eagle-llm): that model's law against the "
                             "target's, exactly, into the record")
    parser.add_argument("--power", type=int, help="run at this N in stored seed blocks (module docstring)")
    parser.add_argument("--batch-size", type=int, default=500, help="generations per seed block (--power)")
    parser.add_argument("--min-expected", type=float, default=50.0, help="a cell's least expected count (--power)")
    parser.add_argument("--status", action="store_true", help="with --power: each library's stored blocks, and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    from specresearch.experiments.executor import add_executor_arguments

    add_executor_arguments(parser)
    args = parser.parse_args(argv)
    if args.executor != "local" and args.power is None:
        parser.error("--executor runs a power run's seed blocks: pass --power N too")
    if args.status and args.power is None:
        parser.error("--status reads the blocks of a power run: pass --power N too")
    if args.worker:
        kind, _, name = args.worker.rpartition(":")
        run = {"smallest": smallest, "base": base_law, "": worker}[kind]
        print("RESULT " + json.dumps(run(name, args)), flush=True)
        return 0
    from specresearch.experiments.records import git_commit, record_header, write_json_record

    out = Path(args.out)
    command = sys.argv[1:] if argv is None else list(argv)
    record = (json.loads(out.read_text()) if out.exists()
              else record_header("benchmarks/audit_libraries.py", command, draft="v8k-4l", rows=[]))
    if args.smallest:
        result, why = _in_worker(f"smallest:{args.smallest}", [f"--samples={args.samples}"])
        if result is None:
            raise RuntimeError(why)
        record.setdefault("smallest_inputs", {})[args.smallest] = result
        write_json_record(out, record)
        return 0
    if args.base_law:
        result, why = _in_worker(f"base:{args.base_law}", [f"--prompt={args.prompt}",
                                                           f"--temperature={args.temperature}"])
        if result is None:
            raise RuntimeError(why)
        record.setdefault("base_models", {})[args.base_law] = result | {"commit": git_commit()}
        write_json_record(out, record)
        print(json.dumps(result))
        return 0
    if args.status:
        print("\n".join(status(args, record)))
        return 0
    done = {done_key(row) for row in record["rows"]}
    for name in args.only or LIBRARIES:
        if (name, args.power) in done or (args.power is not None and not _agreed(record, name)):
            continue
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("out", "only", "worker", "smallest", "status") and v is not None]
        row, why = _in_worker(name, flags)
        row = row or {"library": name, "distribution": LIBRARIES[name][0], "ran": False, "why": why}
        print(row.get("finding") or row.get("why"), flush=True)
        if out.exists():  # another process (--only) may have added a row since
            record = json.loads(out.read_text())
        record["rows"].append(row)
        write_json_record(out, record)
    return 0


def _agreed(record: dict, name: str) -> bool:
    """Whether library ``name`` ran here and kept the target's law: a power run is for those (one that does not run
    would say so again, and one whose law the smaller run already rejected is a finding at that N)."""
    return any(row["library"] == name and row.get("ran") and row["finding"].startswith("agrees") for row in record["rows"])


def status(args, record: dict) -> list[str]:
    """One line a library whose smaller run kept the target's law: its power run at ``--power`` in the record, or how
    far its stored blocks are (``BlockStore.progress``)."""
    from specresearch.audit.blocks import BlockStore

    done = {done_key(row) for row in record["rows"]}
    return [f"{name} N {args.power}: " + ("done, in the record" if (name, args.power) in done
                                         else BlockStore.progress(blocks_path(name, args), args.power))
            for name in args.only or LIBRARIES if _agreed(record, name)]


if __name__ == "__main__":
    sys.exit(main())
