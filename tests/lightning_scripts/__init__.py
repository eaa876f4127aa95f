"""Scripts that tests/test_lightning.py runs as subprocesses (Lightning's popen launcher re-executes them)."""
