"""One run per folder: the lease raced hundreds of times in one process (threads and processes), stale leases taken
over, and real pairs of runs started at the same moment."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.storage.lease import STALE_AFTER, Held, Holder, Lease
from tests import forked
from tests.conftest import TRAIN_SCRIPT, clean_env, start_ranks
from tests.workers import lease_racer

RACERS = 4


def race(folder: Path, racers: int = RACERS) -> list:
    """`racers` threads take the folder at the same moment; each returns its lease or the Held it got."""
    start = threading.Barrier(racers)

    def contend(_):
        start.wait()
        try:
            return Lease.take(folder)
        except Held as held:
            return held

    with ThreadPoolExecutor(racers) as pool:
        return list(pool.map(contend, range(racers)))


def winners(outcomes: list) -> list:
    return [outcome for outcome in outcomes if not isinstance(outcome, Held)]


def test_of_threads_racing_for_a_folder_exactly_one_wins_every_time(tmp_path):
    for round_ in range(300):
        folder = tmp_path / f"r{round_}"
        folder.mkdir()
        outcomes = race(folder)
        won = winners(outcomes)
        assert len(won) == 1, f"round {round_}: {len(won)} runs hold the folder"
        lease, note = won[0]
        assert note is None
        assert all(held.holder == lease.holder for held in outcomes if isinstance(held, Held)), "name the holder"
        assert [p.name for p in folder.iterdir()] == [lease.path.name], "one lease file, no drafts left"


def stale_lease(folder: Path, generation: int = 1, **holder) -> Path:
    """A lease as a run on another machine wrote it, last refreshed STALE_AFTER + 60 s ago."""
    fields = dict(host="node-7", machine="another-machine", pid=4242, process_start="1", started="then", token="t")
    path = folder / f".claim-{generation}.json"
    path.write_text(json.dumps(fields | holder))
    then = time.time() - STALE_AFTER - 60
    os.utime(path, (then, then))
    return path


def test_of_threads_racing_to_take_over_a_stale_lease_exactly_one_wins_every_time(tmp_path):
    for round_ in range(300):
        folder = tmp_path / f"r{round_}"
        folder.mkdir()
        stale_lease(folder, generation=round_ % 3 + 1)
        won = winners(race(folder))
        assert len(won) == 1, f"round {round_}: {len(won)} runs hold the folder"
        note = won[0][1]
        assert note.startswith("process 4242 on node-7, started then held it, but its lease was not refreshed for")
        assert note.endswith(": taking it over")
        assert [p.name for p in folder.iterdir()] == [won[0][0].path.name], "the stale lease is gone"


def test_of_processes_racing_for_a_folder_exactly_one_wins_every_time(tmp_path):
    context = multiprocessing.get_context("spawn")  # fork would copy this test process's threads
    with context.Manager() as manager, context.Pool(RACERS) as pool:
        for round_ in range(60):
            folder = tmp_path / f"r{round_}"
            folder.mkdir()
            if round_ % 2:
                stale_lease(folder)
            start = manager.Barrier(RACERS)
            outcomes = pool.starmap(lease_racer.take, [(str(folder), start)] * RACERS)
            assert sorted(outcomes) == ["held"] * (RACERS - 1) + ["won"], f"round {round_}: {outcomes}"


def test_a_fresh_lease_of_another_machine_holds_and_one_of_a_gone_process_here_does_not(tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    os.utime(stale_lease(fresh), None)  # refreshed just now, by a process this machine cannot see
    with pytest.raises(Held, match="process 4242 on node-7"):
        Lease.take(fresh)

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here = Holder.this_process()
    killed.kill()
    killed.wait()
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / ".claim-1.json").write_text(json.dumps(vars(here) | {"pid": killed.pid, "process_start": "1"}))
    lease, note = Lease.take(gone)  # its lease is fresh, but its process is gone: no need to wait
    assert lease.generation == 2 and note.endswith("but its process is gone: taking it over")


def test_a_run_that_lost_its_lease_finds_out_when_it_refreshes(tmp_path):
    for takeover in (2, 1):  # the next generation, and a run that found no lease at all and started over
        lease, _ = Lease.take(tmp_path)
        assert lease.refresh()
        lease.path.unlink()  # as if taken over by a run elsewhere after ours went silent
        os.utime(stale_lease(tmp_path, generation=takeover), None)
        assert not lease.refresh()
        for path in tmp_path.iterdir():
            path.unlink()


def start_run(tmp_path, args: list, cwd: Path) -> subprocess.Popen:
    return forked.popen(
        [sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
        cwd=cwd,
        env=clean_env(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def quick_flags(tiny_model_dir, review_files) -> list:
    return [
        *("--model_name_or_path", tiny_model_dir, "--train_file", review_files["train"]),
        *("--validation_file", review_files["validation"], "--per_device_train_batch_size", 8, "--max_length", 32),
        *("--max_steps", 2, "--max_eval_samples", 8, "--disable_tqdm", "--mixed_precision", "no"),
    ]


@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.slow
def test_two_runs_started_together_into_one_folder_one_trains_the_other_exits_2(
    tmp_path, tiny_model_dir, review_files, attempt
):
    args = [*quick_flags(tiny_model_dir, review_files), "--output_dir", tmp_path / "out", "--logdir", tmp_path / "tb"]
    runs = [start_run(tmp_path, [*args, "--run_name", name], tmp_path) for name in ("a", "b")]
    results = [(run, *run.communicate(timeout=300)) for run in runs]
    codes = sorted(run.returncode for run, _, _ in results)
    assert codes == [0, 2], [(run.returncode, err[-1500:]) for run, _, err in results]
    (winner, _, _), (_, _, refused) = sorted(results, key=lambda result: result[0].returncode)
    assert refused.count("\n") == 1 and refused.startswith(f"error: --output_dir {tmp_path / 'out'} is in use"), refused
    assert f"(process {winner.pid} on " in refused, "the holder is named"
    assert not list((tmp_path / "out").glob(".claim-*")), "the winner gave its claim back"
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [winner.args[-1]], "the loser left no folder"


@pytest.mark.slow
def test_two_runs_started_in_the_same_second_get_their_own_default_names(tmp_path, tiny_model_dir, review_files):
    args = [*quick_flags(tiny_model_dir, review_files), "--logdir", tmp_path / "tb"]  # default names and folders
    runs = [start_run(tmp_path, args, tmp_path) for _ in range(2)]
    results = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-1500:] for _, err in results]
    names = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert len(names) == 2 and sorted(p.name for p in (tmp_path / "outputs").iterdir()) == names
    if names[0][:15] == names[1][:15]:  # the same second: the second one took the next suffix
        assert names[1] == f"{names[0]}-2"
    for name in names:
        assert len(list((tmp_path / "tb" / name).glob("events.out.tfevents.*"))) == 1, "one run per TensorBoard folder"


def test_a_default_name_taken_in_the_same_second_gets_the_next_suffix(tmp_path, monkeypatch):
    from app.config import TrainConfig
    from app.storage.folders import FolderClaims, claim_run_folders

    monkeypatch.chdir(tmp_path)  # the default output folder is outputs/<run name>
    cfg = TrainConfig(logdir=str(tmp_path / "tb"))
    for _ in range(5):  # until both claims land in the same second, as two runs started together often do
        runs = [FolderClaims(), FolderClaims()]
        first, second = (claim_run_folders(cfg, "fp32", None, folders) for folders in runs)
        if first.run_name[:15] == second.run_name[:15]:
            break
        for folders in runs:
            folders.remove_created()
    assert second.run_name == f"{first.run_name}-2"
    assert second.output_dir == Path("outputs") / second.run_name
    assert second.log_dir == tmp_path / "tb" / second.run_name
    for folders in runs:
        folders.release()


def test_both_ranks_of_a_second_run_exit_2_and_one_of_them_says_why(tmp_path, tiny_model_dir, review_files):
    """Only the main process claims; the other rank learns the outcome, so the two stop together."""
    out = tmp_path / "out"
    out.mkdir()
    held, _ = Lease.take(out)  # this test process holds the folder, as a live run would
    args = [*quick_flags(tiny_model_dir, review_files), "--output_dir", out, "--logdir", tmp_path / "tb"]
    ranks = start_ranks(args, tmp_path)
    errors = [rank.communicate(timeout=240)[1] for rank in ranks]
    held.release()
    assert [rank.returncode for rank in ranks] == [2, 2], errors
    assert errors[0].startswith(f"error: --output_dir {out} is in use by another run (process {os.getpid()} on ")
    assert errors[1] == ""
    assert list(out.iterdir()) == [] and not (tmp_path / "tb").exists()
