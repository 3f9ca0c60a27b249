"""`import ckptio` leaves ml_dtypes (0.8-1.0 s of CPU to import; 1.1 s from a cold page cache, longer than
the read of a 1 GiB float32 restore) until a bfloat16 or float8 array, saved or restored, needs it; each
check in a fresh interpreter, where nothing imported it before."""


def test_import_and_a_float32_save_and_restore_do_not_import_ml_dtypes(run_python, tmp_path, small):
    out = run_python(f"""
        import sys, numpy as np, ckptio
        assert "ml_dtypes" not in sys.modules
        state = {{"w": np.arange(1000, dtype=np.float32), "step": np.int64(3)}}
        with ckptio.CheckpointManager({str(tmp_path / "r")!r}, **{small!r}) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
            assert "ml_dtypes" not in sys.modules, "a float32 save imported ml_dtypes"
            back = mgr.restore()
            into = {{"w": np.zeros(1000, np.float32), "step": np.zeros((), np.int64)}}
            mgr.restore_into(1, into)
            like = mgr.restore(1, target={{"w": np.zeros(1000, np.float32), "step": np.int64(0)}})
        assert "ml_dtypes" not in sys.modules, "a float32 restore imported ml_dtypes"
        for got in (back, into, like):
            assert got["w"].tobytes() == state["w"].tobytes() and got["w"].dtype == np.float32
            assert int(got["step"]) == 3
        print("ok")
    """)
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_bfloat16_and_float8_arrays_save_when_ml_dtypes_is_imported_after_ckptio(run_python, tmp_path, small):
    out = run_python(f"""
        import numpy as np, ckptio
        import ml_dtypes
        rng = np.random.default_rng(5)
        state = {{"bf": rng.standard_normal(300).astype(ml_dtypes.bfloat16),
                  "e4": rng.standard_normal(64).astype(ml_dtypes.float8_e4m3fn),
                  "e5": rng.standard_normal(64).astype(ml_dtypes.float8_e5m2)}}
        with ckptio.CheckpointManager({str(tmp_path / "r")!r}, **{small!r}) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
            back = mgr.restore()
        for k in state:
            assert back[k].dtype == state[k].dtype and back[k].tobytes() == state[k].tobytes(), k
        print(sorted(str(back[k].dtype) for k in back))
    """)
    assert out.stdout.strip().splitlines()[-1] == "['bfloat16', 'float8_e4m3fn', 'float8_e5m2']"


def test_a_bfloat16_checkpoint_restores_as_bfloat16_in_a_process_that_never_imported_ml_dtypes(
        run_python, tmp_path, small):
    root = str(tmp_path / "r")
    run_python(f"""
        import numpy as np, ckptio, ml_dtypes
        state = {{"bf": np.arange(300, dtype=np.float32).astype(ml_dtypes.bfloat16), "f": np.ones(8, np.float32)}}
        with ckptio.CheckpointManager({root!r}, **{small!r}) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
    """)
    out = run_python(f"""
        import sys, numpy as np, ckptio
        with ckptio.CheckpointManager({root!r}, read_only=True) as mgr:
            back = mgr.restore()
        assert "ml_dtypes" in sys.modules
        import ml_dtypes
        want = np.arange(300, dtype=np.float32).astype(ml_dtypes.bfloat16)
        assert back["bf"].dtype == want.dtype and back["bf"].tobytes() == want.tobytes()
        assert back["f"].tobytes() == np.ones(8, np.float32).tobytes()
        print(back["bf"].dtype)
    """)
    assert out.stdout.strip().splitlines()[-1] == "bfloat16"
