"""A launch that cannot silently shrink: ``accelerate launch --num_processes N`` without ``--multi_gpu`` is refused,
and a resume that leaves out the checkpoint's DeepSpeed or parallel settings says which key restores them. The real
launcher's refusal: tests/integration/test_launch.py."""

from __future__ import annotations

import pytest

from lmrecipe.checkpoint.resume import forgotten_settings
from lmrecipe.parallel.launch import check_launched_processes, shrunk_launch

# What accelerate's simple launcher leaves in its one child process (accelerate 1.15, --num_processes 2): its own
# variables and MASTER_ADDR/PORT, but no WORLD_SIZE or RANK.
SIMPLE_CHILD_ENV = {"ACCELERATE_USE_CPU": "False", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}
VENV_ACCELERATE = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
SCRIPT = ["train.py", "recipes/tiny.yaml", "train.max_steps=2"]


@pytest.mark.parametrize("launcher, flags, expected", [
    (VENV_ACCELERATE, ["--num_processes", "2"], 2),
    (VENV_ACCELERATE, ["--num-processes=4", "--mixed_precision", "no"], 4),
    (["python", "-m", "accelerate.commands.launch"], ["--num_processes", "2"], 2),
    (["python", "-m", "accelerate.commands.accelerate_cli", "launch"], ["--num_processes", "2"], 2),
    (VENV_ACCELERATE, ["--cpu", "--num_processes", "2"], 2),
    (VENV_ACCELERATE, ["--num_processes", "1"], None),
    (VENV_ACCELERATE, [], None),
    (VENV_ACCELERATE, ["--multi_gpu", "--num_processes", "2"], None),  # (its children have WORLD_SIZE anyway)
    (VENV_ACCELERATE, ["--use_deepspeed", "--num_processes", "2"], None),
    (["python", "train.py"], [], None),  # not a launcher
    (["bash", "job.sh"], ["--num_processes", "2"], None),
])
def test_shrunk_launch_reads_the_launchers_command_line(launcher, flags, expected):
    # the script's own arguments may look like launcher flags; they are the script's
    assert shrunk_launch(SIMPLE_CHILD_ENV, [*launcher, *flags, *SCRIPT, "--num_processes", "8"]) == expected


def test_a_distributed_launchers_process_or_a_plain_one_is_not_questioned():
    argv = [*VENV_ACCELERATE, "--num_processes", "2", *SCRIPT]
    assert shrunk_launch({**SIMPLE_CHILD_ENV, "WORLD_SIZE": "2", "RANK": "0"}, argv) is None
    assert shrunk_launch({}, argv) is None  # not started by accelerate's launcher
    assert shrunk_launch(SIMPLE_CHILD_ENV, None) is None  # no parent command line to read


def test_a_shrunk_launch_is_refused_naming_the_flag(monkeypatch):
    import lmrecipe.parallel.launch as launch

    monkeypatch.setattr(launch, "_parent_command_line", lambda: [*VENV_ACCELERATE, "--num_processes", "2", *SCRIPT])
    for key, value in SIMPLE_CHILD_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(Exception) as err:
        check_launched_processes()
    assert getattr(err.value, "exit_code", None) == 2
    assert "--multi_gpu --num_processes 2" in str(err.value) and "tools/launch_flags.py" in str(err.value)


@pytest.mark.parametrize("saved, ours, expected", [
    ({"deepspeed_config": "zero2"}, {"deepspeed_config": None}, ["distributed.deepspeed_config=zero2"]),
    ({"deepspeed_config": "zero2", "tensor_parallel_size": 2}, {"deepspeed_config": None},
     ["distributed.deepspeed_config=zero2", "distributed.tensor_parallel_size=2"]),
    ({"deepspeed_config": "zero3", "sequence_parallel_size": 2}, {"deepspeed_config": "zero3"},
     ["distributed.sequence_parallel_size=2"]),
    ({"deepspeed_config": "zero2"}, {"deepspeed_config": "zero3"}, []),  # a change to another value is a choice
    ({"deepspeed_config": None}, {"deepspeed_config": "zero2"}, []),
])
def test_a_resume_names_the_parallel_settings_left_out(saved, ours, expected):
    assert forgotten_settings({"distributed": saved}, {"distributed": ours}) == expected
