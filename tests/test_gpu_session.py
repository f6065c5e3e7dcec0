"""scripts/gpu_session.sh on the CPU with stand-in GPUs (an `nvidia-smi` that lists two): a `+` group of
premerge stages gives each stage without CPUS its own share of the cores, and keeps a stage's own CPUS."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _stand_in(tmp_path, name: str, script: str) -> Path:
    """An executable `name` running `script` in tmp_path/bin (made if missing), the folder to put first on PATH."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    path = stub / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return stub


def _stand_in_cards(tmp_path, cards: str) -> Path:
    """An `nvidia-smi` whose name query lists `cards` (one per line)."""
    return _stand_in(tmp_path, "nvidia-smi",
                     f'#!/bin/bash\n[[ "$*" == *--query-gpu=name,* ]] && echo "name, driver"\nprintf "{cards}"\n')


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_group_premerge_stages_get_their_share_of_the_cores(tmp_path):
    from verify.devices import cpu_share, usable_cpu_list

    stub = _stand_in(tmp_path, "nvidia-smi",
                     '#!/bin/bash\n[[ "$*" == *--list-gpus* ]] && printf "GPU 0: stand-in\\nGPU 1: stand-in\\n"\n')
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{stub}:{os.environ['PATH']}", OUT=str(out),
               PROFILE="smoke", WPG="1")
    cpus = usable_cpu_list()
    own = f"{cpus[0]}"
    group = f"premerge:1:bf16-model:share_a+premerge:1:bf16-model:own_b:{own}"
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", group], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    timings = (out / "timings.txt").read_text()
    first_share = ",".join(map(str, cpu_share(cpus, 0, 2)))
    assert f"premerge share_a on 1 GPU(s), cores {first_share}, backends bf16-model: exit 0" in timings, timings
    assert f"premerge own_b on 1 GPU(s), cores {own}, backends bf16-model: exit 0" in timings, timings


@pytest.mark.parametrize(("cards", "required", "runs"), [
    ("NVIDIA H100 80GB HBM3", "H200", False), ("NVIDIA H200\nNVIDIA H100 80GB HBM3", "H200", False),
    ("", "H200", False), ("NVIDIA H200\nNVIDIA H200", "H200", True), ("NVIDIA H100 80GB HBM3", "", True)])
def test_require_card_runs_no_stage_on_another_card(tmp_path, cards, required, runs):
    """REQUIRE_CARD: the stages run only when every GPU's name contains it (none listed counts as another card);
    otherwise the cards found are written and the script exits 3 before any stage."""
    stub = _stand_in_cards(tmp_path, cards)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{stub}:{os.environ['PATH']}", OUT=str(out),
               REQUIRE_CARD=required)
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "env"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    if runs:
        assert proc.returncode == 0 and (out / "env.txt").exists() and not (out / "card.txt").exists(), proc.stdout
    else:
        assert proc.returncode == 3 and not (out / "env.txt").exists(), proc.stdout + proc.stderr
        assert (out / "card.txt").read_text().startswith(f"REQUIRE_CARD={required}, but the GPUs are: ")


@pytest.mark.parametrize(("cards", "other_card"), [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", False)])
def test_other_card_stages_run_instead_on_another_card(tmp_path, cards, other_card):
    """With OTHER_CARD_STAGES, a machine whose cards fail REQUIRE_CARD runs those stages instead of none (here an
    `ab` stage, through the stand-in probe) and says so in card.txt; the required card runs the command line's."""
    _stand_in_cards(tmp_path, cards)
    stub = _stand_in_probe(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out), REQUIRE_CARD="H200",
               OTHER_CARD_STAGES="ab:scratch/base", AB_ROWS="gem", AB_ROUNDS="1")
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "env"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "env.txt").exists() is not other_card
    assert (out / "ab.txt").exists() is other_card
    if other_card:
        assert (out / "card.txt").read_text() == (
            f"REQUIRE_CARD=H200, but the GPUs are: {cards}; running OTHER_CARD_STAGES instead: ab:scratch/base\n")
    else:
        assert not (out / "card.txt").exists()


def _stand_in_probe(tmp_path) -> Path:
    """A `python3` first on PATH whose `scripts/ab_probe.py measure` records its side and PYTHONPATH and writes a
    record per row (kernel ms by side: base 4, mine 3, a candidate 2; short_ws_kernel a quarter of it for a
    candidate, half otherwise); everything else goes to the real interpreter."""
    return _stand_in(tmp_path, "python3", """#!/bin/bash
if [[ "$1" == scripts/ab_probe.py && "$2" == measure ]]; then
  echo "$3 $PYTHONPATH" >> "$OUT/calls.txt"
  case ${3%%:*} in base) ms=4; short=2 ;; mine) ms=3; short=1.5 ;; *) ms=2; short=0.5 ;; esac
  fmt='{"tag": "%s", "row": "%s", "op": "fwd", "kernels_ms": %s, "bits": "a", '
  fmt+='"by_kernel": {"short_ws_kernel": %s}}\\n'
  for row in "${@:5}"; do printf "$fmt" "$3" "$row" "$ms" "$short" >> "$4"; done
  exit 0
fi
exec REAL_INTERPRETER "$@"
""".replace("REAL_INTERPRETER", sys.executable))


def test_ab_stage_measures_each_candidate_in_every_round(tmp_path):
    """AB_MORE's candidate trees are measured after base and this tree in each round, each with its own folder
    first on PYTHONPATH, and the summary compares each with base (AB_KERNEL: one kernel's ms only)."""
    stub = _stand_in_probe(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out), AB_ROWS="gem tiny", AB_ROUNDS="2",
               AB_MORE="scratch/vK4 scratch/vA")

    def ab_stage():
        return subprocess.run(["bash", "scripts/gpu_session.sh", "ab:scratch/base"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    proc = ab_stage()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [line.split() for line in (out / "calls.txt").read_text().splitlines()]
    assert [tag for tag, _ in calls] == ["base:1", "mine:1", "vK4:1", "vA:1", "base:2", "mine:2", "vK4:2", "vA:2"]
    folders = {tag.split(":")[0]: path.split(":")[0] for tag, path in calls}
    assert folders == {"base": f"{REPO}/scratch/base", "mine": str(REPO), "vK4": f"{REPO}/scratch/vK4",
                       "vA": f"{REPO}/scratch/vA"}
    summary = (out / "ab.txt").read_text().splitlines()
    assert [line for line in summary if "against base" in line] == ["mine against base", "vK4 against base",
                                                                   "vA against base"]
    assert summary[summary.index("vK4 against base") + 2].split()[:5] == ["gem", "fwd", "4.000", "2.000", "0.500"]

    env["AB_KERNEL"] = "short_ws"
    ab_stage()
    summary = (out / "ab.txt").read_text().splitlines()
    assert summary[summary.index("vK4 against base (short_ws only)") + 2].split()[:5] == [
        "gem", "fwd", "2.000", "0.500", "0.250"]

    env["AB_MORE"] = "scratch/mine"
    proc = ab_stage()
    assert "AB_MORE: scratch/mine: a candidate's name is its side's, not base or mine" in proc.stdout


def test_memcheck_runs_with_the_caching_allocator_off(tmp_path):
    """memcheck and initcheck see an access past a tensor only when the tensor is an allocation of its own, so
    their stages turn PyTorch's caching allocator off; racecheck (shared memory) keeps it. A stand-in
    compute-sanitizer records the setting and the command it was given."""
    stub = _stand_in(tmp_path, "compute-sanitizer", '#!/bin/bash\n'
                     'echo "${PYTORCH_NO_CUDA_MEMORY_CACHING:-unset} $*" >> "$OUT/sanitizer_calls.txt"\n')
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out))
    env.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
    stages = ["sanitizer:memcheck:triton", "sanitizer:racecheck:triton:1/3", "sanitizer:initcheck:triton"]
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", *stages], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [line.split(" --jfa-results")[0] for line in (out / "sanitizer_calls.txt").read_text().splitlines()]
    common = ("--error-exitcode 9 python3 -m pytest -q -p no:cacheprovider verify/ --jfa-profile smoke "
              "--jfa-backend triton")
    assert calls == [f"1 --tool memcheck {common} --shard 0/1", f"unset --tool racecheck {common} --shard 1/3",
                     f"1 --tool initcheck {common} --shard 0/1"]


def test_group_env_sets_one_stage_of_a_group(tmp_path):
    """GROUP_ENV_i's assignments apply to the group's i-th stage alone (an overflow premerge's PYTEST_ARGS beside
    a sanitizer shard); the other stages keep the environment's settings. Stand-ins record, per GPU, the command
    compute-sanitizer is given and the limit timeout is given."""
    stub = _stand_in(tmp_path, "compute-sanitizer",
                     '#!/bin/bash\necho "$*" >> "$OUT/calls_$CUDA_VISIBLE_DEVICES.txt"\n')
    _stand_in(tmp_path, "nvidia-smi", '#!/bin/bash\nprintf "GPU 0: stand-in\\nGPU 1: stand-in\\n"\n')
    _stand_in(tmp_path, "timeout", '#!/bin/bash\necho "$1" >> "$OUT/limits_$CUDA_VISIBLE_DEVICES.txt"\n'
              'shift\nexec "$@"\n')
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out), PYTEST_ARGS="-k forward",
               GROUP_ENV_1='SANITIZER_TIMEOUT=99 PYTEST_ARGS="-k backward --jfa-case uniform:0"')
    group = "sanitizer:memcheck:triton:0/2+sanitizer:memcheck:triton:1/2"
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", group], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    calls = [(out / f"calls_{gpu}.txt").read_text().split(" --jfa-results")[0] for gpu in (0, 1)]
    assert calls[0].endswith("--jfa-backend triton --shard 0/2 -k forward"), calls[0]
    assert calls[1].endswith("--jfa-backend triton --shard 1/2 -k backward --jfa-case uniform:0"), calls[1]
    assert [(out / f"limits_{gpu}.txt").read_text().split() for gpu in (0, 1)] == [["240"], ["99"]]


def test_fuzz_stage_searches_for_its_seconds(tmp_path):
    """The fuzz stage runs python -m verify fuzz on its backend for its seconds (240 by default), a line per
    case, with FUZZ_ARGS added; a stand-in python3 records the calls."""
    stub = _stand_in(tmp_path, "python3", '#!/bin/bash\nif [[ "$1 $2 $3" == "-m verify fuzz" ]]; then '
                     f'echo "${{*:4}}" >> "$OUT/calls.txt"; exit 0; fi\nexec {sys.executable} "$@"\n')
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out), FUZZ_ARGS="--seed 7")
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "fuzz:triton:90", "fuzz:bf16-model"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "calls.txt").read_text().splitlines() == [
        "--backend triton --seconds 90 --examples 100000 -v --seed 7",
        "--backend bf16-model --seconds 240 --examples 100000 -v --seed 7"]


def test_repeat_stage_perturbs_both_modes(tmp_path):
    """The repeat stage runs verify.repeat with --perturb, deterministic first, then the default mode, with
    REPEAT_ARGS added; a stand-in python3 records the calls."""
    stub = _stand_in(tmp_path, "python3", '#!/bin/bash\nif [[ "$1 $2" == "-m verify.repeat" ]]; then '
                     f'echo "${{*:3}}" >> "$OUT/calls.txt"; exit 0; fi\nexec {sys.executable} "$@"\n')
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", OUT=str(out), REPEAT_ARGS="--seed 3")
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "repeat:triton:50"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "calls.txt").read_text().splitlines() == [
        "--backend triton --runs 50 --perturb --deterministic --seed 3",
        "--backend triton --runs 50 --perturb --seed 3"]
