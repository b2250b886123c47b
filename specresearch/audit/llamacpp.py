"""llama.cpp's own code, run: its server (built by ``scripts/build_llamacpp.sh`` from the source vendored in the
llama-cpp-python sdist) on the embedded GGUF, for :func:`specresearch.audit.execute.execute`.

* :func:`llamacpp_bin` finds the built binaries (``$SPECRESEARCH_LLAMACPP`` or the script's cache folder).
* :func:`write_scaled_draft` writes the draft llama.cpp's speculative decoding needs as a GGUF: a copy of the target
  whose ``output_norm.weight`` is multiplied by c, so its logits are c times the target's (the same argmax, a sharper
  or flatter law; its vocabulary is the target's, which llama.cpp's compatibility check asks for). Written with
  llama.cpp's own ``gguf-py``.
* :class:`LlamaServer` starts ``llama-server`` on a local port the system picks for one model (and a draft), and
  :meth:`LlamaServer.complete` posts a ``/completion`` request: token ids in, token ids and the sampler's final
  probabilities out.

The server samples the first generated token from the target after the prompt; its speculative steps start with
the second (``tools/server/server-context.cpp``: drafting follows a sampled token). Its drafts are capped at the
tokens left to generate minus one (``get_n_draft_max``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

__all__ = ["LLAMACPP_VERSION", "llamacpp_bin", "llamacpp_home", "write_scaled_draft", "write_truncated_draft", "LlamaServer", "SAMPLING",
           "run_speculative", "simple_steps", "simple_tokens", "speculative_tokens"]

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built (llama.cpp 0c1e570)
# The server's sampling defaults (common/common.h): what a request that sets nothing gets.
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
_START_SECONDS = 120
_ROW_ATTEMPTS = 64
_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def llamacpp_home() -> Path:
    """Where ``scripts/build_llamacpp.sh`` builds: ``$SPECRESEARCH_LLAMACPP`` or ``<cache>/llamacpp/<version>``."""
    from specresearch.paths import cache_dir

    return Path(os.environ.get("SPECRESEARCH_LLAMACPP") or cache_dir("llamacpp", LLAMACPP_VERSION))


def llamacpp_bin(name: str = "llama-server") -> Path:
    """The built binary ``name``; ``FileNotFoundError`` saying how to build it when it is absent."""
    path = llamacpp_home() / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not built: run `bash scripts/build_llamacpp.sh` once on this machine "
                                "(cmake, tens of minutes on 2 cores)")
    return path


def _gguf():
    """llama.cpp's ``gguf`` package from the built source tree."""
    home = llamacpp_home() / "gguf-py"
    if str(home) not in sys.path and home.is_dir():
        sys.path.insert(0, str(home))
    try:
        import gguf
    except ImportError as error:
        raise FileNotFoundError(f"llama.cpp's gguf-py is not at {home}: run `bash scripts/build_llamacpp.sh`") from error
    return gguf


def write_truncated_draft(target_gguf: str | os.PathLike, out: str | os.PathLike, layers: int) -> Path:
    """The first ``layers`` blocks of ``target_gguf`` with its embeddings, final norm and head, at ``out`` (the
    ``truncated:N`` draft of :func:`specresearch.drafts.registry.truncated_draft` in llama.cpp's format, quantised as
    the target is). Kept when ``out`` already holds it."""
    out = Path(out)
    if out.is_file():
        return out
    gguf = _gguf()
    reader = gguf.GGUFReader(target_gguf)
    arch = reader.fields["general.architecture"].contents()
    if not 1 <= layers < reader.fields[f"{arch}.block_count"].contents():
        raise ValueError(f"layers must be in 1..{reader.fields[f'{arch}.block_count'].contents() - 1}, got {layers}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's counts and the architecture the writer writes itself
        value = layers if name == f"{arch}.block_count" else field.contents()
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)
    if "general.alignment" in reader.fields:
        writer.data_alignment = reader.fields["general.alignment"].contents()
    kept = [t for t in reader.tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers)]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data)
    writer.close()
    os.replace(partial, out)
    return out


def write_scaled_draft(target_gguf: str | os.PathLike, out: str | os.PathLike, scale: float) -> Path:
    """A copy of ``target_gguf`` at ``out`` whose ``output_norm.weight`` is multiplied by ``scale``: logits c times
    the target's. Kept when ``out`` already holds this scale's copy."""
    out = Path(out)
    stamp = out.with_suffix(".scale")
    if out.is_file() and stamp.is_file() and stamp.read_text() == repr(float(scale)):
        return out
    GGUFReader = _gguf().GGUFReader
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target_gguf, out)
    reader = GGUFReader(out, "r+")
    (norm,) = [t for t in reader.tensors if t.name == "output_norm.weight"]
    if norm.data.dtype.kind != "f":
        raise ValueError(f"output_norm.weight is stored as {norm.data.dtype}, not a float type")
    norm.data[...] = norm.data * scale
    reader.data.flush()
    del reader
    stamp.write_text(repr(float(scale)))
    return out


def _die_with_parent() -> None:
    """In the server's process, before it starts: ask Linux to end it when this Python process ends, so a killed
    run leaves no server behind (elsewhere nothing; ``__exit__`` stops it on a normal end)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass


class LlamaServer:
    """``llama-server`` on ``model`` (and ``draft``) at a free local port, one slot, ``threads`` threads; ``args``:
    more command-line flags (e.g. ``["--spec-synth-rates", "0.5,0.25,0.125"]``). A context manager."""

    def __init__(self, model, draft=None, *, threads: int = 1, context: int = 1024, args=()):
        self.alias = f"specresearch-{os.getpid()}-{os.urandom(4).hex()}"  # its name in /props and its log's
        self.command = [str(llamacpp_bin("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                        "--port", "0", "-c", str(context), "-np", "1", "-t", str(threads),
                        "-tb", str(threads), "--no-warmup", "--alias", self.alias,
                        *([] if draft is None else ["-md", str(draft), "-td", str(threads)]), *args]
        self.process, self.started = None, False

    def __enter__(self) -> "LlamaServer":
        # --port 0: the server binds a port the system picks and logs it, so two servers never race for one
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.alias}.log", "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent)
        self.url, deadline = None, time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: see {self.log.name}")
            if self.url is None:
                bound = _LISTENING.search(Path(self.log.name).read_text(errors="replace"))
                self.url = bound and f"http://127.0.0.1:{bound.group(1)}"
            if self.url is not None and self._answers():
                self.started = True
                return self
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"llama-server did not start within {_START_SECONDS} s: see {self.log.name}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                if reply.status != 200:
                    return False
            with urllib.request.urlopen(self.url + "/props", timeout=10) as reply:
                alias = json.loads(reply.read()).get("model_alias")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        if alias != self.alias:
            raise RuntimeError(f"another server ({alias!r}) answers on {self.url}, which {self.log.name} says is this one's")
        return True

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        if self.started and exc[0] is None:  # a log is kept only where something went wrong
            Path(self.log.name).unlink(missing_ok=True)

    def complete(self, tokens: list[int], **request) -> dict:
        """POST ``/completion`` with ``prompt`` = ``tokens`` and ``request``'s fields; the reply's JSON."""
        body = json.dumps({"prompt": list(tokens), **request}).encode()
        ask = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=300) as reply:
            return json.loads(reply.read())

    def _post(self, path: str, body: dict) -> dict:
        ask = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(ask, timeout=60) as reply:
            return json.loads(reply.read())

    def tokenize(self, text: str) -> list[int]:
        """``text`` as llama.cpp's command-line examples tokenize a prompt (``common_tokenize(ctx, prompt, true,
        true)``: the vocabulary's BOS added if it asks for one, special tokens parsed)."""
        return [int(t) for t in self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]]

    def detokenize(self, tokens: list[int]) -> str:
        return self._post("/detokenize", {"tokens": list(tokens)})["content"]

    def version(self) -> str:
        with urllib.request.urlopen(self.url + "/props", timeout=10) as reply:
            props = json.loads(reply.read())
        return f"llama.cpp {props.get('build_info', '?')} (llama-cpp-python {LLAMACPP_VERSION} sdist)"

    def row(self, tokens: list[int], vocab: int, sampling: dict) -> torch.Tensor:
        """The law the server samples the next token from after ``tokens``: its sampler chain's final
        probabilities (``post_sampling_probs``), as a dense ``[vocab]`` float64 row. Needs ``top_k`` >= 1 so that
        ``n_probs = top_k`` covers the support."""
        for seed in range(_ROW_ATTEMPTS):
            # a sampled token that ends inside a UTF-8 character is reported without its probabilities (the server
            # adds a token to its reply only once its text is whole: server-context.cpp l. 1825-1859); the law does
            # not depend on the draw, so draw again
            reply = self.complete(tokens, n_predict=1, n_probs=int(sampling["top_k"]), post_sampling_probs=True,
                                  seed=seed, **sampling)
            if reply.get("completion_probabilities"):
                break
        else:
            raise RuntimeError(f"llama-server returned no probabilities after {len(tokens)} tokens in {_ROW_ATTEMPTS} "
                               f"draws (each a token ending inside a UTF-8 character?): {reply.get('content')!r}")
        row = torch.zeros(vocab, dtype=torch.float64)
        for entry in reply["completion_probabilities"][0]["top_probs"]:
            row[int(entry["id"])] = float(entry["prob"])
        return row / row.sum()


# llama-speculative's debug lines about a token (examples/speculative/speculative.cpp l. 324, 327 and 448): a draft
# token accepted or rejected, and the token each step ends with (a residual draw, or the target's own after the
# drafts). A token's text may hold anything, a line break too: each line is matched up to its closing "') ".
_VERDICT = re.compile(r"draft token \d+ of sequence \d+ \((\d+), '.*?'\) (accepted|rejected)\n", re.DOTALL)
_STEP_END = re.compile(r"the sampled target token \((\d+), '.*?'\) did not match", re.DOTALL)


def speculative_tokens(log: str) -> list[int]:
    """The tokens ``llama-speculative`` generated, in order, from its debug log (``-lv 5``): each accepted draft token
    and each step's last token (a rejected draft token is not emitted)."""
    found = [(m.start(), int(m.group(1))) for m in _VERDICT.finditer(log) if m.group(2) == "accepted"]
    found += [(m.start(), int(m.group(1))) for m in _STEP_END.finditer(log)]
    return [token for _, token in sorted(found)]


# llama-speculative-simple's (examples/speculative-simple/speculative-simple.cpp l. 323): each step's accepted count
# and last token; its drafted tokens are the draft's top candidates, logged as candidate 0 at each position
# (common/speculative.cpp l. 357).
_SIMPLE_STEP = re.compile(r"accepted (\d+)/\d+ draft tokens, the last target token is: \((\d+)\)")
_SIMPLE_DRAFT = re.compile(r"draft candidate +0, pos +\d+: +(\d+) ")


def simple_steps(log: str) -> list[tuple[list[int], int, int]]:
    """``llama-speculative-simple``'s steps from its debug log (``-lv 5``), in order: ``(drafted, accepted, last)``,
    the tokens it drafted for the step, how many of them it kept and the step's last token."""
    steps, drafted = [], []
    for line in log.splitlines():
        if (draft := _SIMPLE_DRAFT.search(line)) is not None:
            drafted.append(int(draft.group(1)))
        elif (step := _SIMPLE_STEP.search(line)) is not None:
            steps.append((drafted, int(step.group(1)), int(step.group(2))))
            drafted = []
    return steps


def simple_tokens(log: str) -> list[int]:
    """The tokens ``llama-speculative-simple`` generated, in order, from its debug log (``-lv 5``): at each step the
    first ``accepted`` of the tokens it drafted, then the step's last token."""
    return [token for drafted, accepted, last in simple_steps(log) for token in drafted[:accepted] + [last]]


# llama.cpp's examples print this line after their loop (examples/speculative/speculative.cpp l. 645,
# examples/speculative-simple/speculative-simple.cpp l. 356): a log that holds it holds every step before it
_LOG_END = "n_accept  = "
_LOG_ATTEMPTS = 5


def run_speculative(model, draft, prompt: str, *, seed: int, n_predict: int, sampling: dict, n_parallel: int = 1,
                    draft_max: int = 3, p_split: float = 0.1, threads: int = 1, context: int = 512,
                    simple: bool = False, with_log: bool = False):
    """One run of llama.cpp's ``llama-speculative`` example (unmodified) on ``model`` with ``draft``, sampling with
    ``sampling`` (temperature, top_k, top_p, min_p) and ``seed`` (its verifier's and samplers' seed): the tokens it
    generated, one step past ``n_predict`` (it stops after the step that passes it) unless an end-of-generation
    token came first. ``-fit off``: the models are loaded once each, not probed for memory first.

    The example's verifier draws from ``std::default_random_engine`` seeded with ``seed`` (l. 69), in libstdc++
    ``minstd_rand0``, whose first draw is 16807 x seed mod (2^31 - 1): consecutive seeds give nearly equal first
    uniforms, so runs meant to be independent need seeds spread over its range (``LlamaSpeculativeRun`` draws them).

    ``simple=True``: ``llama-speculative-simple`` instead, the common speculative loop the server runs (drafts of the
    draft model's top tokens, ``--spec-draft-p-min 0`` so that it drafts whatever their probability, verified by
    sampling the target and comparing); ``n_parallel`` and ``p_split`` do not apply. ``with_log``: return
    ``(tokens, log)``.

    With ``n_parallel`` > 1 the example's tree batch (branches as coupled sequences) fails to decode in this version
    ("split_equal: sequential split is not supported when there are coupled sequences", then "failed to find a
    memory slot"), logged, not fatal: it asks for a unified KV cache, which the example cannot be given (``-kvu`` is
    registered for the server, perplexity, batched, bench and parallel examples only, ``common/arg.cpp`` l. 1724-1730,
    and ``LLAMA_ARG_KV_UNIFIED`` does not reach it either).

    The tokens are read from the debug log, which llama.cpp writes from a thread of its own and does not flush when
    the program ends (``common/log.cpp``, ``common_log_main``: "this design may cause logs to be lost if not flushed
    before the program exits"): on a loaded machine a run's last lines, its last step among them, can be lost. A log
    is whole when it holds the counts both examples print after their loop (``n_accept  =``); one without is run
    again with the same seed (the same generation: the run is a function of its seed), up to ``_LOG_ATTEMPTS`` times,
    then ``RuntimeError``. Redrawing on a condition that does not depend on the tokens leaves the law as it is."""
    if simple:
        binary, extra = "llama-speculative-simple", ["--spec-type", "draft-simple", "--spec-draft-p-min", "0"]
    else:
        binary, extra = "llama-speculative", ["-np", str(n_parallel), "--spec-draft-p-split", repr(float(p_split))]
    command = [str(llamacpp_bin(binary)), "-m", str(model), "-md", str(draft), "-p", prompt,
               "-n", str(n_predict), "-s", str(seed), "--spec-draft-n-max", str(draft_max), *extra,
               "-t", str(threads), "-tb", str(threads), "-c", str(context),
               "--temp", repr(float(sampling["temperature"])), "--top-k", str(int(sampling["top_k"])),
               "--top-p", repr(float(sampling["top_p"])), "--min-p", repr(float(sampling["min_p"])),
               "-fit", "off", "--no-escape", "-lv", "5"]
    for _ in range(_LOG_ATTEMPTS):
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL,
                              timeout=300, preexec_fn=_die_with_parent)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout)[-2000:]
            raise RuntimeError(f"{binary} exited with {done.returncode}:\n{tail}")
        log = done.stderr + done.stdout
        if _LOG_END in log:
            break
    else:
        raise RuntimeError(f"{binary}'s log was cut short in {_LOG_ATTEMPTS} runs of seed {seed} (no {_LOG_END.strip()!r} "
                           "line): its tokens cannot be read from it")
    if simple and "draft candidate" not in log:
        raise RuntimeError("llama-speculative-simple drafted nothing: its speculative decoding was off")
    tokens = (simple_tokens if simple else speculative_tokens)(log)
    return (tokens, log) if with_log else tokens
