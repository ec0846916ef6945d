"""The learner group's backend: decided once by the leader from every learner's device."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from impala_rl import distributed
from impala_rl.distributed import agree_backend, choose_backend, device_identity


def test_learners_on_gpus_of_their_own_use_nccl(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    backend, _ = choose_backend(["cuda|a|GPU-1", "cuda|a|GPU-2", "cuda|b|GPU-1"])
    assert backend == "nccl"


def test_learners_sharing_a_gpu_use_gloo_and_say_which(monkeypatch):
    """``algorithm.device=cuda:0`` with two learners puts both on one GPU: NCCL refuses it."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    backend, why = choose_backend(["cuda|a|GPU-1", "cuda|a|GPU-1"])
    assert backend == "gloo" and "GPU-1" in why


def test_a_learner_off_the_gpu_makes_the_group_gloo(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert choose_backend(["cuda|a|GPU-1", "cpu|a"])[0] == "gloo"
    assert choose_backend(["cpu|a", "cpu|a"])[0] == "gloo"


def test_a_cpu_learners_identity_names_its_host():
    assert device_identity(torch.device("cpu")).startswith("cpu|")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpus_identity_is_the_same_whatever_index_names_it():
    assert device_identity(torch.device("cuda")) == device_identity(torch.device("cuda", 0))


def test_every_learner_gets_the_leaders_decision(monkeypatch):
    """A Ray leader sees its node's GPUs, each Ray peer one (``cuda:0``, its own): each
    deciding alone, the leader picked NCCL and the peers gloo. Agreed, all pick the same."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    identities = {0: "cuda|head|GPU-a", 1: "cuda|head|GPU-b", 2: "cuda|node2|GPU-a"}
    monkeypatch.setattr(distributed, "device_identity", lambda device: identities[device.index])
    assert _agree_in_threads(3) == {0: "nccl", 1: "nccl", 2: "nccl"}
    identities[1] = "cuda|head|GPU-a"  # a peer placed on the leader's GPU
    assert _agree_in_threads(3) == {0: "gloo", 1: "gloo", 2: "gloo"}


def _agree_in_threads(world_size: int) -> dict[int, str]:
    """Each rank's :func:`agree_backend` in a thread of its own (the leader last), on one
    store; the rank's device is ``cuda:rank``."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout, wait_for_workers=False)
    chosen: dict[int, str] = {}

    def learner(rank: int) -> None:
        own = (
            store
            if rank == 0
            else dist.TCPStore("127.0.0.1", store.port, world_size, False, timeout)
        )
        chosen[rank] = agree_backend(own, rank, world_size, torch.device("cuda", rank))

    threads = [threading.Thread(target=learner, args=(r,)) for r in reversed(range(world_size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return chosen


def test_on_ray_the_leaders_gpu_is_held_so_further_learners_get_others(monkeypatch):
    """The leader runs in Ray's driver, whose GPU Ray does not count: without a hold, Ray
    gave a further learner the leader's GPU. Three (declared) GPUs, the leader on the second."""
    ray = pytest.importorskip("ray")
    from impala_rl.distributed import LeaderGpuHold, ray_gpu_id

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ray_gpu_id(torch.device("cuda", 1)) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert ray_gpu_id(torch.device("cuda", 1)) == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    ray.init(num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=False)
    try:
        hold = LeaderGpuHold(torch.device("cuda", 1), 1.0)
        assert hold.holder is not None
        learner = ray.remote(num_cpus=0, num_gpus=1)(distributed._GpuPlaceholder)
        peers = [learner.remote() for _ in range(2)]
        given = sorted(i for p in peers for i in ray.get(p.gpu_ids.remote(), timeout=60))
        assert given == ["0", "2"]
        hold.release()
        for p in peers:
            ray.kill(p)
    finally:
        ray.shutdown()
