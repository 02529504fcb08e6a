"""device_mesh validation: bad indices, partial overlaps and role splits are refused before anything loads."""

import pytest
import torch

from hybridrl.config.schema import ConfigError
from hybridrl.parallel.placement import Placement, resolve_placement


def test_default_is_everything_colocated():
    placement = resolve_placement(None, num_gpus=2, num_visible=2)
    assert placement == Placement((0, 1), (0, 1), (0, 1), (0, 1))
    assert placement.colocated and placement.device("critic", 1) == torch.device("cuda", 1)


def test_bad_index_names_key_visible_devices_and_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(ConfigError) as info:
        resolve_placement({"actor": [0], "reward": [2]}, num_gpus=1, num_visible=2)
    message = str(info.value)
    assert "trainer.device_mesh.reward uses CUDA device 2" in message
    assert "only 2 CUDA device(s) are visible (0, 1)" in message
    assert "CUDA_VISIBLE_DEVICES='2,3'" in message and "use indices below 2" in message


def test_no_gpu_visible_is_clear(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match=r"trainer.num_gpus uses CUDA device 0, but no CUDA device is visible; "
                                          r"CUDA_VISIBLE_DEVICES is not set"):
        resolve_placement(None, num_gpus=1, num_visible=0)


def test_partial_overlap_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"actor=\[0, 1\] and trainer.device_mesh.critic=\[1, 2\] share device\(s\) "
                                          r"\[1\] but are not the same group"):
        resolve_placement({"actor": [0, 1], "critic": [1, 2]}, num_gpus=2, num_visible=4)


def test_reward_on_its_own_gpu_with_one_actor_process():
    placement = resolve_placement({"actor": [0], "reward": [1]}, num_gpus=1, num_visible=2)
    assert placement.device("actor") == torch.device("cuda", 0)
    assert placement.device("reward") == torch.device("cuda", 1)
    assert placement.device("ref") == torch.device("cuda", 0)  # unlisted roles follow the actor


def test_sharded_role_apart_from_several_actor_processes_is_refused():
    with pytest.raises(ConfigError, match=r"ref=\[2\] is apart from the actor's 2 devices"):
        resolve_placement({"actor": [0, 1], "ref": [2]}, num_gpus=2, num_visible=3)


def test_reward_devices_of_their_own_are_taken_in_turn_by_several_processes():
    """Issue 7's split: 6 training processes, the reward model on GPUs 6 and 7 (3 processes per reward GPU)."""
    placement = resolve_placement({"actor": list(range(6)), "reward": [6, 7]}, num_gpus=6, num_visible=8)
    assert [placement.device("reward", rank).index for rank in range(6)] == [6, 7, 6, 7, 6, 7]
    assert [placement.device("actor", rank).index for rank in range(6)] == list(range(6))
    assert placement.device("ref", 5) == torch.device("cuda", 5) and not placement.colocated
    with pytest.raises(ConfigError, match=r"reward lists 3 devices \[2, 3, 4\] for 2 training process\(es\).*"
                                          r"List at most 2"):
        resolve_placement({"actor": [0, 1], "reward": [2, 3, 4]}, num_gpus=2, num_visible=5)


@pytest.mark.parametrize("mesh, num_gpus, pattern", [
    ({"policy": [0]}, 1, "unknown role 'policy'; the roles are actor, critic, ref, reward"),
    ({"actor": []}, 1, "must be a non-empty list"),
    ({"actor": [0, 0]}, 1, "lists a device twice"),
    ({"actor": [-1]}, 1, r"integers >= 0"),
    ({"actor": [0, 1]}, 1, "set trainer.num_gpus=2"),
])
def test_malformed_mesh(mesh, num_gpus, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_placement(mesh, num_gpus=num_gpus, num_visible=4)


def test_cpu_runs_ignore_placement_but_refuse_a_mesh():
    assert resolve_placement(None, num_gpus=2, device_type="cpu").device("actor", 1) == torch.device("cpu")
    with pytest.raises(ConfigError, match="trainer.device is cpu"):
        resolve_placement({"actor": [0]}, device_type="cpu")
