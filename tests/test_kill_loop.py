"""The kill loop in its short form (`benchmarks/kill_loop.py`; the long form's figures are in docs/benchmarks.md):
SIGKILLs at random phases, a resume after each, and the run still ends bitwise equal to an uninterrupted one."""

from benchmarks.kill_loop import PHASES, kill_loop, passed, report


def test_a_run_killed_at_random_phases_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    result = kill_loop(tmp_path, kills=3, total_steps=5, seed=1)
    assert passed(result), report(result)
    assert result["kills"] == 3 and set(result["by_phase"]) <= set(PHASES)
    assert result["events"][-1]["target"] == "save_model"  # the final save is cut too, and redone on resume
