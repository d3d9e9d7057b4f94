"""CI's choice of stages (``.ci/run``, ``CI_PLAN=1``): main, full and tpu at every stop; of the
integrations, the longest owed since its last green main in ``.ci/landed`` (at most
``CI_INTEGRATIONS``), each other one named with its reason; with none owed, the rotation's turn."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("heavy", "vllm", "vllm-engine", "vllm-decode", "verl", "sglang")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def _commit(repo: Path, path: str, text: str) -> str:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", path)
    return _git(repo, "rev-parse", "HEAD")


def _plan(repo: Path, **env: str) -> dict:
    # Without the CI_* settings of a CI run the suite may be inside (CI_STAGES would pick the
    # stages itself and plan nothing).
    ours = {k: v for k, v in os.environ.items() if not k.startswith("CI_")}
    out = subprocess.run(["bash", ".ci/run"], cwd=repo, capture_output=True, text=True, timeout=60,
                         env={**ours, "CI_PLAN": "1", **env}, check=True).stdout
    plan = {}
    for line in out.splitlines():
        name, _, rest = line.strip().partition(": ")
        if name in STAGES and name not in plan:
            plan[name] = rest
    return plan


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    (tmp_path / ".ci" / "landed").unlink()
    first = _commit(tmp_path, "torchtpu/core.py", "a = 1\n")
    return tmp_path, first


def _landed(repo: Path, **commits: str) -> None:
    text = "".join(f"{name} {sha}\n" for name, sha in commits.items())
    _commit(repo, ".ci/landed", "# the last green main of each stage\n" + text)


def test_a_changed_integration_runs_and_the_others_do_not(repo):
    path, first = repo
    _landed(path, **dict.fromkeys(STAGES, first))
    # (.ci/landed's own commit changed nothing a stage owns)
    _commit(path, "tests/test_sglang.py", "x = 1\n")
    _commit(path, "torchtpu/core.py", "a = 2\n")  # the core: no integration's own
    plan = _plan(path)
    assert plan["sglang"].startswith("run (tests/test_sglang.py changed"), plan
    assert all(plan[n].startswith("not run") for n in STAGES if n != "sglang"), plan


def test_at_most_the_cap_runs_the_longest_owed_first_and_the_rest_are_named_owed(repo):
    path, first = repo
    _commit(path, "tests/test_verl.py", "x = 1\n")
    later = _commit(path, "tests/test_titan.py", "x = 1\n")
    halves = {"vllm-engine": first, "vllm-decode": first}
    _landed(path, heavy=first, verl=later, vllm=first, sglang=first, **halves)
    _commit(path, "tests/test_verl.py", "x = 2\n")
    plan = _plan(path)  # heavy owes since first, verl since later: heavy runs
    assert plan["heavy"].startswith("run (tests/test_titan.py changed"), plan
    assert plan["verl"].startswith("owed, not run at this stop (tests/test_verl.py"), plan
    assert plan["vllm"].startswith("not run") and plan["sglang"].startswith("not run"), plan
    both = _plan(path, CI_INTEGRATIONS="2")
    assert both["heavy"].startswith("run") and both["verl"].startswith("run"), both


def test_a_stage_without_a_green_run_is_owed_and_with_none_owed_the_turn_runs(repo):
    path, first = repo
    _landed(path, heavy=first, vllm=first, verl=first, **{"vllm-engine": first,
                                                          "vllm-decode": first})
    plan = _plan(path)
    assert plan["sglang"].startswith("run (no green run of it"), plan
    _landed(path, **dict.fromkeys(STAGES, first))
    plan = _plan(path)
    ran = [n for n in STAGES if plan[n].startswith("run (its turn in the rotation")]
    count = int(_git(path, "rev-list", "--count", "HEAD"))
    assert ran == [STAGES[count % len(STAGES)]], plan
