"""No module-level ``etils.epy.lazy_imports`` runs after the trainer's setup has started threads: it swaps
``builtins.__import__`` for the whole process, so an import in any other thread (the reward pool's manager thread
imports ``multiprocessing.connection`` on every poll) gets a lazy stand-in and fails ("'LazyModule' object is not
callable", seen in a 2-process run when the prompt iterator imported Grain after the pool had started)."""
import subprocess
import sys
import threading

LAZY_SOURCE = "grain._src.python.dataset.sources.parquet_dataset"  # runs `with epy.lazy_imports():` on import


def test_the_trainer_setup_imports_grain_before_any_thread_starts():
    code = f"import sys, stapo_jax.train.run_setup; print({LAZY_SOURCE!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "True"


def test_an_import_in_another_thread_during_lazy_imports_gets_a_stand_in():
    """The hazard itself: inside ``epy.lazy_imports()`` another thread's ``from x import y`` is not the real
    object (why the order above matters)."""
    from etils import epy

    got = {}
    with epy.lazy_imports():
        t = threading.Thread(target=lambda: got.update(wait=__import__("multiprocessing.connection",
                                                                       fromlist=("wait",)).wait))
        t.start()
        t.join(timeout=30)
    import multiprocessing.connection

    assert got["wait"] is not multiprocessing.connection.wait and not callable(got["wait"])
