"""DDP and FSDP2, unchanged, under torchrun on remote_accel: two ranks, each on a server of
its own, end where one process trained on the whole batch ends."""

from __future__ import annotations

from torchrun_jobs import server_stats, torchrun

DDP_MODES = ("plain", "no_sync", "find_unused", "static_graph", "fp16_hook", "bf16_hook", "compiled")
#: how far each mode may end from one process in fp32: the same sums in another order,
#: or gradients reduced in 16 bits
TOLERANCE = {"fp16_hook": 1e-3, "bf16_hook": 1e-2}


def test_ddp_in_every_mode_ends_with_one_process_s_parameters(two_servers):
    before = [server_stats(s)["group_bytes_sent"] for s in two_servers]
    job = torchrun("ddp_job.py", 2, two_servers, ",".join(DDP_MODES))
    assert job.returncode == 0, job.text()
    results = job.starting("RESULT")
    assert sorted(r.split()[0] for r in results) == sorted(DDP_MODES * 2), job.text()  # every mode on both ranks
    # the scenario: the gradients were reduced by raccl, server to server
    assert all(int(c) >= 20 for c in job.starting("collectives")), job.text()
    assert all(server_stats(s)["group_bytes_sent"] > b for s, b in zip(two_servers, before))
    for mode, diff in (r.split() for r in results):
        assert float(diff) <= TOLERANCE.get(mode, 1e-5), (mode, diff)


def test_fsdp2_trains_like_one_process_and_resumes_from_its_distributed_checkpoint(two_servers, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    trained = torchrun("fsdp_job.py", 2, two_servers, "train", checkpoint)
    assert trained.returncode == 0, trained.text()
    assert len(trained.starting("saved")) == 2, trained.text()  # both ranks wrote their shards
    losses = {}
    for line in trained.starting("LOSS"):
        step, loss, alone = line.split()
        losses[int(step)] = float(loss)
        assert abs(float(loss) - float(alone)) <= 1e-5, line  # the mean loss of the ranks is one process's
    assert sorted(losses) == list(range(6)), trained.text()

    resumed = torchrun("fsdp_job.py", 2, two_servers, "resume", checkpoint)
    assert resumed.returncode == 0, resumed.text()
    resumed_losses = {int(line.split()[0]): float(line.split()[1]) for line in resumed.starting("LOSS")}
    assert sorted(resumed_losses) == [3, 4, 5], resumed.text()  # it went on from the checkpoint's step
    for step, loss in resumed_losses.items():
        assert loss == losses[step], (step, loss, losses[step])  # the same losses as the run that went on
