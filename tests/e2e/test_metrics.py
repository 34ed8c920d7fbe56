"""End to end: the server's /metrics scraped while the real client device trains over TCP;
the server's figures and the client's own counters (remote_accel.stats()) agree exactly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

import remote_accel
from remote_accel.server.testing import scrape

pytestmark = pytest.mark.any_torch

STEPS = 6


SERVER_ARGS = ("--metrics", "127.0.0.1:0")


def _train(steps: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("remote_accel")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16).to("remote_accel")
        y = torch.randint(0, 4, (8,)).to("remote_accel")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _agreeing(server):
    """(client counters, scrape) at a moment when no message is in flight: a heartbeat the
    client just sent may not have reached the server yet, so look again until they agree."""
    deadline = time.monotonic() + 60
    while True:
        torch.remote_accel.synchronize()
        mine = remote_accel.stats()
        s = scrape(server.metrics_url)
        [slot] = s.labels("remote_accel_client_info", "client")
        theirs = (s.value("remote_accel_client_bytes_received_total", client=slot),
                  s.value("remote_accel_client_bytes_sent_total", client=slot))
        if theirs == (mine["bytes_sent"], mine["bytes_received"]) or time.monotonic() > deadline:
            return mine, s, slot
        time.sleep(0.05)


def test_scraped_while_training_and_counts_agree(remote):
    before_client, before, slot = _agreeing(remote)
    scrapes, failures, stop = [], [], threading.Event()

    def scraper():  # Prometheus (or ra-top) reading all along
        while not stop.is_set():
            try:
                scrapes.append(scrape(remote.metrics_url).value("remote_accel_ops_total"))
            except Exception as exc:  # kept for the assertion below
                failures.append(exc)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        losses = _train(STEPS)
    finally:
        stop.set()
        thread.join(60)
    assert len(losses) == STEPS and all(l == l for l in losses)
    assert not failures and len(scrapes) >= 1
    assert scrapes == sorted(scrapes)  # a counter never goes back

    mine, after, slot_after = _agreeing(remote)
    assert slot_after == slot  # the same session throughout

    def server_delta(name, **labels):
        return after.value(name, **labels) - before.value(name, **labels)

    ops = mine["ops"] - before_client["ops"]
    batches = mine["batches"] - before_client["batches"]
    assert ops > 10 * STEPS and batches >= 1
    assert server_delta("remote_accel_ops_total") == ops
    assert server_delta("remote_accel_client_ops_total", client=slot) == ops
    assert server_delta("remote_accel_batches_total") == batches
    assert server_delta("remote_accel_batch_seconds_count") == batches
    assert server_delta("remote_accel_bytes_received_total", transport="tcp") == (
        mine["bytes_sent"] - before_client["bytes_sent"])
    assert server_delta("remote_accel_bytes_sent_total", transport="tcp") == (
        mine["bytes_received"] - before_client["bytes_received"])
    assert after.value("remote_accel_memory_bytes", client=slot) == torch.remote_accel.memory_allocated()
    assert mine["round_trips"] - before_client["round_trips"] >= STEPS  # one loss.item() per step


def test_client_side_figures():
    counters = remote_accel.stats()
    assert remote_accel.stats is torch.remote_accel.stats
    for key in ("ops", "batches", "graphs", "round_trips", "bytes_up", "bytes_down", "bytes_sent",
                "bytes_received", "messages_sent", "messages_received"):
        assert isinstance(counters[key], int) and counters[key] >= 0, key
    x = torch.ones(1000, device="remote_accel")
    after = remote_accel.stats()
    assert after["ops"] > counters["ops"]  # counted when issued, before any flush
    assert x.cpu().sum().item() == 1000
    assert remote_accel.stats()["bytes_down"] == after["bytes_down"] + 4000  # the .cpu() read

    stats = torch.remote_accel.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.remote_accel.memory_allocated() >= 4000
    assert stats["allocated_bytes.all.peak"] == torch.remote_accel.max_memory_allocated()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"]
    assert stats["allocation.all.current"] >= 1 and stats["limit_bytes"] > 0
    assert "transport" not in stats and "ops_done" not in stats  # memory only


def test_gauges_return_to_zero_when_the_client_leaves(remote):
    # a tensor of its own: the earlier tests' tensors are freed, and the timer flush
    # tells the server so within milliseconds
    held = torch.ones(1000, device="remote_accel")
    torch.remote_accel.synchronize()
    s = scrape(remote.metrics_url)
    assert s.value("remote_accel_clients") == 1 and s.value("remote_accel_memory_bytes") > 0
    remote_accel.shutdown()
    deadline = time.monotonic() + 60
    while (s := scrape(remote.metrics_url)).value("remote_accel_clients") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.value("remote_accel_clients") == 0
    assert s.value("remote_accel_memory_bytes") == 0
    assert "remote_accel_client_info" not in s
    del held
