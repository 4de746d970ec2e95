"""Issue 31, second part: a live run's directory, empty streams before the first batch, keyed
signatures (``EPOCHAL_CHECKPOINT_KEY``) and the fuzz campaign over every file kind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from epochal_checkpoint import UnsignedCheckpointError, list_checkpoints, read_checkpoint, storage
from epochal_checkpoint.fuzz import MAX_READ_BYTES, POINTER_KINDS, fuzz, make_pristine
from epochal_checkpoint.storage import KEY_ENV, SIGNATURE, find_latest, load
from epochal_checkpoint.testing import TORTURE_CONFIG, force_crc32, resign

from epochal.testing import epochal_command

OLDER, NEWEST = "ckpt-e0001-i000016", "ckpt-e0002-i000032"
KEY = "a key only the owner knows"


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def train(project: Path, key: str | None = None, *args: str) -> subprocess.CompletedProcess[str]:
    """``epochal run run.toml`` (two epochs, a checkpoint each) in *project*, signed with *key*."""
    if not (project / "run.toml").exists():
        (project / "run.toml").write_text(TORTURE_CONFIG.format(size=1000, every=0, async_save="false"))
    env = {KEY_ENV: key} if key is not None else {}
    return epochal_command("run", "run.toml", "--set", "loop.max_epochs=2", *args, cwd=project, env=env)


@pytest.fixture
def signed(tmp_path: Path) -> Path:
    """A project after a two-epoch run signed with KEY: ``run/version_0/checkpoints`` holds OLDER, NEWEST."""
    done = train(tmp_path, KEY)
    assert done.returncode == 0, done.stderr
    directory = tmp_path / "run" / "version_0" / "checkpoints"
    assert [info.name for info in list_checkpoints(directory)[0]] == [OLDER, NEWEST]
    return directory


def forge(checkpoint: Path, in_place: bool = False) -> np.ndarray:
    """Change the first float of model array p0 in ``data.bin``; return the forged array.

    The CRC-32s are made to agree, as anyone who can write the files can: re-signed (the index
    and the manifest rewritten: ``testing.resign``), or *in_place* (the next float chosen so that
    the record's CRC-32 is unchanged: the manifest and the index stay byte for byte)."""
    state, _ = read_checkpoint(checkpoint)
    data = bytearray((checkpoint / "data.bin").read_bytes())
    at = data.index(state["model"]["p0"].tobytes())
    data[at : at + 4] = np.float32(1234.5).tobytes()
    if in_place:
        entries = storage.read_state_document(checkpoint)["arrays"]
        start = next(e["offset"] for e in entries if e["path"] == ["model", "p0"])
        end = min([e["offset"] for e in entries if e["offset"] > start] + [at + state["model"]["p0"].nbytes])
        record = data[start:end]
        force_crc32(
            record, at + 4 - start, int(next(e["crc32"] for e in entries if e["offset"] == start), 16)
        )
        data[start:end] = record
    (checkpoint / "data.bin").write_bytes(data)
    if not in_place:
        resign(checkpoint)
    return np.frombuffer(data[at : at + state["model"]["p0"].nbytes], np.float32)


# -- a live run's directory ----------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from epochal_checkpoint.lock import DirectoryLock
lock = DirectoryLock(Path(sys.argv[1]), "live-run-id")
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_fresh_run_into_a_live_runs_directory_names_the_run_and_does_not_advise_resume(
    tmp_path: Path,
) -> None:
    # a directory set in the config is shared by its runs (by default each run has its own)
    shared = ("--set", "plugins.checkpoint.dir=shared")
    assert train(tmp_path, None, *shared).returncode == 0
    directory = tmp_path / "shared"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        fresh = one_error_line(train(tmp_path, None, *shared))
        for fragment in ("is in use", "live-run-id", f"pid {holder.pid}", "on host", "wait for it"):
            assert fragment in fresh, fresh
        assert "--resume" not in fresh
        resumed = one_error_line(train(tmp_path, None, *shared, "--resume"))
        assert "in use" in resumed and "live-run-id" in resumed
        # by default a fresh run has a directory of its own: the live run is no obstacle
        assert train(tmp_path).returncode == 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert [info.name for info in list_checkpoints(directory)[0]] == [OLDER, NEWEST]
    # the run ended: the earlier run's checkpoints are what is left, and --resume is the advice
    after = one_error_line(train(tmp_path, None, *shared))
    assert "already holds 2 checkpoint(s)" in after and "--resume" in after and "in use" not in after


# -- empty streams -------------------------------------------------------------------------------

STREAMS = """
from epochal_checkpoint.testing import make_data as synthetic

def make_data(empty="valid"):
    data = synthetic(examples=64)
    data[empty] = []
    return data
"""

EMPTY_CONFIG = """
[loop]
max_epochs = 2
run_dir = "run"

[model]
factory = "epochal_checkpoint.testing:make_model"
size = 100

[data]
factory = "streams:make_data"
"""


@pytest.fixture
def empty_project(tmp_path: Path) -> Path:
    (tmp_path / "streams.py").write_text(STREAMS)
    (tmp_path / "run.toml").write_text(EMPTY_CONFIG)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["valid", "train"])
def test_an_empty_sized_stream_is_one_line_before_anything_is_written(
    empty_project: Path, stream: str
) -> None:
    """Every installed plugin (checkpoint, sqlite_log...) runs; the error comes before any writes."""
    before = sorted(p.name for p in empty_project.iterdir())
    result = epochal_command("run", "run.toml", "--set", f"data.empty={stream}", cwd=empty_project)
    line = one_error_line(result)
    assert f"stream {stream!r} yielded no batch: it is empty" in line and "[loop] on_empty_stream" in line, (
        line
    )
    assert sorted(p.name for p in empty_project.iterdir() if p.name != "__pycache__") == before


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "ignore"])
def test_the_on_empty_stream_policy_lets_a_run_with_an_empty_eval_stream_go_on(
    empty_project: Path, policy: str
) -> None:
    result = epochal_command(
        "run",
        "run.toml",
        "--set",
        f"loop.on_empty_stream={policy}",
        "--disable",
        "sqlite_log",
        cwd=empty_project,
    )
    assert result.returncode == 0, result.stderr
    warned = [
        line for line in result.stderr.splitlines() if "stream 'valid' yielded no batch: it is empty" in line
    ]
    assert len(warned) == (1 if policy == "warn" else 0), result.stderr
    assert [info.name for info in list_checkpoints(empty_project / "run" / "version_0" / "checkpoints")[0]]


# -- signatures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("in_place", [False, True], ids=["resigned", "crc-forced"])
def test_a_forged_data_bin_loads_without_a_key_and_is_refused_with_one(
    signed: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    assert (signed / NEWEST / SIGNATURE).is_file() and (signed / OLDER / SIGNATURE).is_file()
    manifest = (signed / NEWEST / "manifest.json").read_bytes()
    forged = forge(signed / NEWEST, in_place)
    assert ((signed / NEWEST / "manifest.json").read_bytes() == manifest) == in_place
    monkeypatch.delenv(KEY_ENV, raising=False)
    state, _ = read_checkpoint(signed / NEWEST)  # integrity is not authenticity: CRC-32s agree
    assert state["model"]["p0"][0] == 1234.5 and np.array_equal(state["model"]["p0"], forged)

    monkeypatch.setenv(KEY_ENV, KEY)
    culprit = "data.bin" if in_place else "manifest.json"  # re-signing rewrote the manifest
    with pytest.raises(UnsignedCheckpointError, match=f"{NEWEST}': {culprit} does not match its signature"):
        read_checkpoint(signed / NEWEST)
    with pytest.warns(RuntimeWarning, match=f"{NEWEST}.*trying the previous checkpoint"):
        read, failures = find_latest(signed)
    assert read.name == OLDER and [path.name for path, _ in failures] == [NEWEST]


def test_data_bin_is_checked_before_any_byte_of_it_is_parsed(
    signed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    forge(signed / NEWEST, in_place=True)

    def parsed(*args: object) -> None:
        raise AssertionError("data.bin was parsed before its signature was checked")

    monkeypatch.setattr(load, "parse_json", parsed)
    monkeypatch.setattr(load, "parse_npy_header", parsed)
    monkeypatch.setenv(KEY_ENV, KEY)
    with pytest.raises(UnsignedCheckpointError, match=r"data\.bin does not match its signature"):
        read_checkpoint(signed / NEWEST)


def test_a_wrong_key_or_a_missing_signature_is_refused(signed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    assert read_checkpoint(signed / NEWEST)[1]["name"] == NEWEST  # the right key reads it
    monkeypatch.setenv(KEY_ENV, KEY + "!")
    with pytest.raises(UnsignedCheckpointError, match=r"manifest\.json does not match its signature"):
        read_checkpoint(signed / NEWEST)
    monkeypatch.setenv(KEY_ENV, KEY)
    (signed / NEWEST / SIGNATURE).unlink()
    with pytest.raises(UnsignedCheckpointError, match=f"has no {SIGNATURE}"):
        read_checkpoint(signed / NEWEST)
    monkeypatch.delenv(KEY_ENV)
    assert read_checkpoint(signed / NEWEST)[1]["name"] == NEWEST  # without a key: not looked at


def test_a_forged_log_segment_costs_only_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment changed in place with its CRC-32 kept (the manifest untouched); two signed
    checkpoints, each writing a segment (``make_pristine``)."""
    signed = make_pristine(tmp_path / "checkpoints", key=KEY)
    newest = list_checkpoints(signed)[0][-1].name
    segment = sorted((signed / newest).glob("log-*.json"))[-1]
    data = bytearray(segment.read_bytes())
    crc = zlib.crc32(data)
    done = re.search(rb'"epochs_done":\d', data)  # the epoch-end record of the segment's rows
    assert done is not None, data
    data[done.start() : done.end()] = b'"epochs_done":7'
    force_crc32(data, data.index(b"}}") - 4, crc)  # 4 bytes of the last value: what CRC-32 misses
    segment.write_bytes(data)
    monkeypatch.setenv(KEY_ENV, KEY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read, failures = find_latest(signed)
    assert read.name == newest and failures == []
    assert [name for name, _ in read.damaged] == [segment.name]
    assert all(row.get("epochs_done") != 7 for row in read.state["log"]["rows"].values())
    assert any(f"{segment.name} does not match its signature" in str(w.message) for w in caught)


@pytest.mark.slow
def test_resume_with_a_key_falls_back_past_a_forged_checkpoint_or_errors_in_one_line(signed: Path) -> None:
    project = signed.parents[2]  # project/run/version_0/checkpoints
    forge(signed / NEWEST)
    resumed = train(project, KEY, "--resume", "--set", "loop.max_epochs=3")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{NEWEST}': manifest.json does not match its signature" in resumed.stderr
    assert f"resumed from checkpoint {signed.relative_to(project) / OLDER}" in resumed.stderr + resumed.stdout

    refused = one_error_line(train(project, "another key", "--resume", "--set", "loop.max_epochs=4"))
    assert "does not match its signature" in refused and KEY_ENV in refused


# -- the fuzz campaign ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_fuzzed_files_and_latest_link_end_cleanly_within_the_bounds(tmp_path: Path, key: str | None) -> None:
    """>= 200 mutations of each file kind (data.bin, manifest, log segments, signature.json when
    signed, the latest link): no raw exception, no case over 5 s, no read over 512 MB; with a
    key, no damage to data.bin or the manifest loads (fuzz() counts that as a failure)."""
    pristine = make_pristine(tmp_path / "pristine", key=key)
    kinds = len(list(list_checkpoints(pristine)[0][-1].path.iterdir())) + 1  # + latest
    report = fuzz(pristine, tmp_path / "work", cases=200 * kinds, children=2, memory_mb=200, key=key)
    assert report.failures == []
    assert min(report.per_file.values()) >= 200 and set(report.per_file) >= {
        "data.bin",
        "manifest.json",
        "latest",
    }
    assert any(name.startswith("log-") for name in report.per_file)
    assert (SIGNATURE in report.per_file) == (key is not None)
    assert set(POINTER_KINDS) <= set(report.per_kind)
    assert report.fallbacks > report.cases // 5
    assert 0 < report.largest_read <= MAX_READ_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_fuzzed_sharded_checkpoints_end_cleanly_and_run_nothing(tmp_path: Path, key: str | None) -> None:
    """Issue 44: a TorchModel's sharded checkpoints (DCP's .metadata and .distcp among the
    files), each read case then loaded as a resume loads it: no raw exception, no payload run
    (``pickle-payload`` plants os.system, eval, getattr chains, torch globals); a damaged
    .metadata falls back. The bench runs >= 300 a file kind (bench/fuzz_checkpoint.py --sharded)."""
    pytest.importorskip("torch")
    pristine = make_pristine(tmp_path / "pristine", key=key, sharded=True)
    files = {p.name for p in list_checkpoints(pristine)[0][-1].path.iterdir()} | {"latest"}
    assert {".metadata", "__0_0.distcp"} <= files
    report = fuzz(pristine, tmp_path / "work", cases=40 * len(files), children=2, memory_mb=300, key=key)
    assert report.failures == [] and report.executed == 0
    assert min(report.per_file.values()) >= 40 and set(report.per_file) == files
    assert report.per_kind["pickle-payload"] > 0
    assert report.fallbacks > report.cases // 5
