"""The C++ part of the device (remote_accel.pytorch_ext._C), against real torch.

The PrivateUse1 rename can happen once per process, so every test runs its scenario in a
fresh interpreter: PRELUDE renames the backend, registers the smallest device module torch
needs, and a boxed fallback that records the ops reaching it (and refuses them: no server
here). A crash in the child (e.g. a segfault) fails the test.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("torch")

PRELUDE = textwrap.dedent(
    """
    import contextlib, copy, gc, io, types
    from remote_accel import _torch_hook
    _torch_hook.skip()  # this test registers a device of its own, not remote_accel's
    import torch
    from remote_accel.pytorch_ext import _native

    C = _native.load()
    torch.utils.rename_privateuse1_backend("remote_accel")
    dev = types.ModuleType("remote_accel_test_device")
    dev.is_available = lambda: True
    dev.device_count = C.device_count
    dev.current_device = C.current_device
    dev._is_in_bad_fork = lambda: False
    dev.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    dev.manual_seed_all = lambda s: [C.default_generator(i).manual_seed(s) for i in range(C.device_count())]

    @contextlib.contextmanager
    def _device(d):
        index = d if isinstance(d, int) else torch.device(d).index
        prev = C.exchange_device(C.current_device() if index is None else index)
        try:
            yield
        finally:
            C.set_device(prev)

    dev.device = _device
    torch._register_device_module("remote_accel", dev)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)

    reached = []

    def _record(op, *args, **kwargs):
        reached.append(op._schema.name)
        raise NotImplementedError(f"test fallback reached by {op}")

    _lib = torch.library.Library("_", "IMPL")
    _lib.fallback(_record, dispatch_key="PrivateUse1")
    """
)


def run_scenario(body: str, prelude: str = PRELUDE) -> str:
    """Run prelude + body in a new interpreter; fail with its output unless it exits 0."""
    with tempfile.TemporaryDirectory() as tmp:
        script = pathlib.Path(tmp, "scenario.py")  # a file, so tracebacks show the source line
        script.write_text(prelude + textwrap.dedent(body) + "\nprint('SCENARIO-OK')\n")
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SCENARIO-OK" in proc.stdout, f"exit {proc.returncode}:\n{out}"
    return out


def test_load_is_idempotent_and_versioned():
    run_scenario(
        """
        import remote_accel
        assert _native.load() is C
        assert C.version() == remote_accel.__version__ == "0.1.0"
        """
    )


def test_missing_extension_raises_unavailable_error():
    run_scenario(
        """
        import sys
        sys.modules["remote_accel.pytorch_ext._C"] = None  # what a build without torch leaves
        from remote_accel.errors import UnavailableError
        from remote_accel.pytorch_ext import _native
        try:
            _native.load()
        except UnavailableError as e:
            assert isinstance(e, ImportError) and "--no-build-isolation" in str(e), e
        else:
            raise AssertionError("load() without _C must raise UnavailableError")
        """,
        prelude="",
    )


def test_build_records_the_torch_it_compiled_against():
    run_scenario(
        """
        from remote_accel.pytorch_ext import _build_info
        assert _build_info.TORCH_VERSION == torch.__version__, (_build_info.TORCH_VERSION, torch.__version__)
        """,
        prelude="import torch\n",
    )


def test_torch_changed_under_the_build_raises_before_loading_the_extension(tmp_path):
    # The installed package, copied, with a build record of another torch: what a user has
    # after `pip install torchvision` moved torch under a built remote_accel.
    import remote_accel

    copy = tmp_path / "remote_accel"
    shutil.copytree(pathlib.Path(remote_accel.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "pytorch_ext" / "_build_info.py").write_text('TORCH_VERSION = "2.0.0"\n')
    out = run_scenario(
        """
        import sys
        import torch
        import remote_accel
        from remote_accel.errors import UnavailableError
        assert remote_accel.__file__.startswith(COPY), remote_accel.__file__
        try:
            remote_accel.init(transport="tcp", server="127.0.0.1:9")
        except UnavailableError as e:
            print("ERROR:", e)
        else:
            raise AssertionError("init() under another torch than the build's must raise")
        # refused before anything was loaded or registered
        assert "remote_accel.pytorch_ext._C" not in sys.modules
        assert torch._C._get_privateuse1_backend_name() == "privateuseone"
        """,
        prelude=f"import sys\nCOPY = {str(tmp_path)!r}\nsys.path.insert(0, COPY)\n",
    )
    import torch

    assert "built against torch 2.0.0" in out and f"torch {torch.__version__} is installed now" in out, out
    assert "Rebuild remote_accel for the torch now installed" in out and "is not available" not in out, out


def test_factories_allocate_distinct_storages_without_the_fallback():
    run_scenario(
        """
        x = torch.empty(4, 6, device="remote_accel")
        y = torch.empty_strided((2, 3), (1, 2), dtype=torch.float64, device="remote_accel")
        z = torch.empty(3, 5, device="remote_accel", memory_format=torch.contiguous_format)
        cl = torch.empty(2, 3, 4, 5, device="remote_accel", memory_format=torch.channels_last)
        assert reached == [], reached
        assert (x.shape, x.stride(), x.dtype, str(x.device)) == ((4, 6), (6, 1), torch.float32, "remote_accel:0")
        assert (y.shape, y.stride(), y.dtype) == ((2, 3), (1, 2), torch.float64)
        assert y.untyped_storage().nbytes() == 6 * 8
        assert cl.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()
        ids = [C.storage_id(t) for t in (x, y, z, cl)]
        assert all(i > 0 for i in ids) and len(set(ids)) == 4, ids
        assert C.storage_id(x) == C.storage_id(x.untyped_storage()) == C.storage_id(x.storage())
        assert C.live_storages(0) == 4
        # Every storage has an address range of its own, so overlap checks work.
        starts = sorted((t.data_ptr(), t.untyped_storage().nbytes()) for t in (x, y, z, cl))
        assert all(a + n <= b for (a, n), (b, _) in zip(starts, starts[1:])), starts
        assert C.storage_id(torch.empty(0, device="remote_accel")) == 0
        for bad in (torch.ones(2), torch.ones(2).untyped_storage()):
            try:
                C.storage_id(bad)
            except ValueError as e:
                assert "remote_accel" in str(e)
            else:
                raise AssertionError("storage_id accepted a CPU storage")
        """
    )


def test_view_ops_stay_in_cpp_and_share_the_storage():
    run_scenario(
        """
        real = {"f": lambda d: torch.empty(4, 6, device=d),
                "c": lambda d: torch.empty(4, 6, dtype=torch.complex64, device=d),
                "p": lambda d: torch.empty(4, 6, 2, device=d)}
        views = {
            "view": ("f", lambda t: [t.view(6, 4), t.view(torch.int32)]),
            "reshape": ("f", lambda t: [t.reshape(24), t.reshape(2, -1)]),
            "transpose": ("f", lambda t: [t.transpose(0, 1), t.t(), t.T, t.mT, t.swapaxes(0, 1)]),
            "permute": ("f", lambda t: [t.permute(1, 0), t.movedim(0, 1)]),
            "expand": ("f", lambda t: [t[:, :1].expand(4, 6), t[:1].expand_as(t)]),
            "squeeze": ("f", lambda t: [t[:1].squeeze(), t[:1].squeeze(0), t.unsqueeze(1), t[None, ..., None]]),
            "narrow": ("f", lambda t: [t.narrow(1, 1, 2), t[1], t[1:3], t[:, ::2], t[1:][:, 2:]]),
            "diagonal": ("f", lambda t: [t.diagonal(), t.diagonal(1)]),
            "multi": ("f", lambda t: [*t.unbind(), *t.split(3), *t.chunk(3, 1), *t.split([1, 3]), *t.tensor_split(2)]),
            "flatten": ("f", lambda t: [t.flatten(), t.unflatten(1, (2, 3)), t.view_as(t)]),
            "unfold": ("f", lambda t: [t.unfold(1, 2, 2)]),
            "as_strided": ("f", lambda t: [t.as_strided((2, 2), (1, 2), 3), t.as_strided((3,), (2,))]),
            "alias": ("f", lambda t: [torch.ops.aten.alias(t), t.detach(), torch.ops.aten._neg_view(t),
                                      torch.ops.aten._unsafe_view(t, (24,)), torch.ops.aten._reshape_alias(t, (24,), (1,))]),
            "complex": ("c", lambda t: [t.conj(), t.mH, t.real, t.imag, torch.view_as_real(t),
                                        torch.ops.aten._conj(t), t.conj().t()]),
            "view_as_complex": ("p", lambda t: [torch.view_as_complex(t)]),
        }
        for name, (base, make) in views.items():
            cpu, remote = real[base]("cpu"), real[base]("remote_accel")
            base_id = C.storage_id(remote)
            reached.clear()
            got = make(remote)
            assert reached == [], (name, reached)
            for i, (want, v) in enumerate(zip(make(cpu), got)):
                where = f"{name}[{i}]"
                assert v.device == remote.device, where
                assert C.storage_id(v) == base_id, where
                assert (v.shape, v.stride(), v.storage_offset(), v.dtype) == (
                    want.shape, want.stride(), want.storage_offset(), want.dtype), where
                assert (v.is_conj(), v.is_neg()) == (want.is_conj(), want.is_neg()), where
        # A reshape that needs a copy is a real op: it goes to the fallback.
        reached.clear()
        try:
            real["f"]("remote_accel").t().reshape(24)
        except NotImplementedError:
            pass
        assert reached == ["aten::_copy_from"], reached
        """
    )


def test_freed_ids_are_reported_once_and_views_keep_storage_alive():
    run_scenario(
        """
        assert C.drain_freed(0) == []
        x = torch.empty(8, device="remote_accel")
        sid = C.storage_id(x)
        v = x[2:].view(2, 3)
        del x
        gc.collect()
        assert C.drain_freed(0) == [] and C.live_storages(0) == 1
        del v
        assert C.drain_freed(0) == [sid]
        assert C.drain_freed(0) == [] and C.live_storages(0) == 0
        ids = [C.storage_id(torch.empty(3, device="remote_accel")) for _ in range(3)]
        assert C.drain_freed(0) == ids and len(set(ids)) == 3
        assert C.drain_freed(1) == []
        """
    )


def test_untyped_storage_and_load_do_not_crash():
    run_scenario(
        """
        s = torch.UntypedStorage(10, device="remote_accel")
        assert s.device == torch.device("remote_accel:0") and s.nbytes() == 10
        assert C.storage_id(s) > 0
        assert s.remote_accel().device == s.device and s.is_remote_accel
        buf = io.BytesIO()
        torch.save(torch.arange(5.0), buf)
        buf.seek(0)
        reached.clear()
        try:
            torch.load(buf, map_location="remote_accel")
        except NotImplementedError:
            pass
        # The bytes go up through a copy: the one op the Python side has to carry.
        assert reached and reached[-1] in ("aten::_copy_from", "aten::copy_"), reached
        reached.clear()
        try:
            torch.ones(3).to("remote_accel")
        except NotImplementedError:
            pass
        assert reached == ["aten::_copy_from"], reached
        """
    )


def test_storage_resize_only_where_no_remote_copy_is_needed():
    run_scenario(
        """
        s = torch.empty(6, device="remote_accel").untyped_storage()
        old = C.storage_id(s)
        s.resize_(0)
        assert s.nbytes() == 0 and C.storage_id(s) == 0 and C.drain_freed(0) == [old]
        s.resize_(40)
        assert s.nbytes() == 40 and C.storage_id(s) not in (0, old)
        try:
            s.resize_(80)
        except NotImplementedError as e:
            assert "remote_accel" in str(e)
        else:
            raise AssertionError("grew a remote storage without a remote copy")
        assert s.nbytes() == 40
        """
    )


def test_set_is_metadata_only_and_refuses_growth():
    run_scenario(
        """
        x = torch.empty(4, 6, device="remote_accel")
        t = torch.empty(0, device="remote_accel")
        t.set_(x.untyped_storage(), 2, (2, 2), (1, 2))
        assert (t.shape, t.stride(), t.storage_offset(), C.storage_id(t)) == ((2, 2), (1, 2), 2, C.storage_id(x))
        t.set_(x.untyped_storage(), 0, (3, 4))
        assert t.stride() == (4, 1)
        assert torch.empty(0, device="remote_accel").set_(x).stride() == (6, 1)
        assert torch.empty(0, device="remote_accel").set_(x.untyped_storage()).shape == (24,)
        e = torch.empty(3, device="remote_accel").set_()
        assert e.shape == (0,) and C.storage_id(e) == 0
        assert reached == [], reached
        try:
            torch.empty(0, device="remote_accel").set_(x.untyped_storage(), 20, (5,))
        except RuntimeError as err:
            assert "out of bounds" in str(err) or "remote_accel" in str(err), err
        else:
            raise AssertionError("set_ grew a remote storage")
        assert (t.shape, t.storage_offset(), C.storage_id(t)) == ((3, 4), 0, C.storage_id(x))
        small = torch.empty(2, device="remote_accel")
        try:
            small.set_(x.untyped_storage(), 20, (5,))
        except RuntimeError:
            pass
        assert C.storage_id(small) != C.storage_id(x) and small.shape == (2,), "a refused set_ must not change self"
        """
    )


def test_generator_seed_epoch_and_state():
    run_scenario(
        """
        g = torch.Generator(device="remote_accel")
        assert g.device == torch.device("remote_accel:0")
        gid, seed, epoch = C.generator_info(g)
        assert gid > 0 and seed == g.initial_seed()
        g.manual_seed(1234)
        assert C.generator_info(g) == (gid, 1234, epoch + 1)
        g.manual_seed(1234)
        assert C.generator_info(g)[2] == epoch + 2, "reseeding to the same seed must reach the server"
        g.set_offset(16)
        state = g.get_state()
        assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
        assert int.from_bytes(bytes(state[:8].tolist()), "little") == 1234
        assert int.from_bytes(bytes(state[8:].tolist()), "little") == 16
        other = torch.Generator(device="remote_accel")
        oid, _, oepoch = C.generator_info(other)
        assert oid != gid
        other.set_state(state)
        assert C.generator_info(other) == (oid, 1234, oepoch + 1)
        assert torch.equal(other.get_state(), state) and other.get_offset() == 16
        clone = copy.deepcopy(g)  # clone_state + set_state
        cid, cseed, _ = C.generator_info(clone)
        assert cseed == 1234 and clone.get_offset() == 16 and cid not in (gid, oid)
        try:
            other.set_state(torch.zeros(3, dtype=torch.uint8))
        except RuntimeError as e:
            assert "16 bytes" in str(e)
        else:
            raise AssertionError("accepted a 3-byte state")
        try:
            C.generator_info(torch.Generator())
        except ValueError:
            pass
        else:
            raise AssertionError("generator_info accepted a CPU generator")
        d = C.default_generator(0)
        assert C.default_generator(0) is d and C.default_generator() is d
        did, _, depoch = C.generator_info(d)
        torch.manual_seed(7)
        assert C.generator_info(d) == (did, 7, depoch + 1)
        assert d.initial_seed() == 7
        """
    )


def test_device_guard_and_second_device():
    run_scenario(
        """
        assert C.device_count() == 1 and C.current_device() == 0
        try:
            torch.empty(2, device="remote_accel:1")
        except IndexError:
            pass
        else:
            raise AssertionError("allocated on a device beyond device_count()")
        C.set_device_count(2)
        z = torch.empty(2, device="remote_accel:1")
        assert z.device.index == 1 and z.untyped_storage().device.index == 1
        assert C.current_device() == 0, "the guard must restore the current device"
        assert (C.live_storages(0), C.live_storages(1)) == (0, 1)
        s = torch.UntypedStorage(4, device="remote_accel:1")
        assert s.device.index == 1 and C.live_storages(1) == 2
        with torch.device("remote_accel:1"):
            assert torch.empty(3).device.index == 1
        with torch.remote_accel.device(1):
            assert C.current_device() == 1
            assert torch.empty(3, device="remote_accel").device.index == 1
            assert C.generator_info(torch.Generator(device="remote_accel"))[0] > 0
            assert torch.Generator(device="remote_accel").device.index == 1
        assert C.current_device() == 0
        torch.accelerator.set_device_index(1)
        assert C.current_device() == 1 and torch.accelerator.current_device_index() == 1
        torch.accelerator.set_device_index(0)
        assert torch.accelerator.device_count() == 2
        assert C.default_generator(1) is not C.default_generator(0)
        zid = C.storage_id(z)
        C.drain_freed(0), C.drain_freed(1)  # the temporaries above
        del z
        assert C.drain_freed(1) == [zid] and C.drain_freed(0) == []
        assert torch.Stream(device="remote_accel:1").device_index == 1
        # events order nothing across servers (each runs its session in issue order, and
        # data crosses devices only by copies the destination waits for): complete at once,
        # so that autograd can run backward through a model split over two devices
        event = torch.Event(device="remote_accel:1")
        event.record(torch.Stream(device="remote_accel:1"))
        assert event.query()
        torch.Stream(device="remote_accel:0").wait_event(event)
        """
    )


def test_autocast_and_pinned_memory():
    run_scenario(
        """
        assert torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.AutocastPrivateUse1)
        x = torch.empty(4, 6, device="remote_accel")
        with torch.autocast("remote_accel", dtype=torch.bfloat16):
            v = x.view(24).t()
        assert v.shape == (24,) and reached == []
        p = torch.ones(3).pin_memory()
        assert p.device.type == "cpu" and torch.equal(p, torch.ones(3))
        """
    )
