"""ChannelOptions' defaults are the shim's (shim_conn_opts_default, which fills the
options of a connection made without any): two copies of one set of numbers, held
together here."""

from __future__ import annotations

from remote_accel.dataplane import dpdk


def test_channel_options_defaults_are_the_shims():
    shim = dpdk.ffi.new("struct shim_conn_opts *")
    dpdk.lib.shim_conn_opts_default(shim)
    ours = dpdk.ChannelOptions().cdata()
    fields = [name for name, _ in dpdk.ffi.typeof("struct shim_conn_opts").fields]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(shim, f) for f in fields}
