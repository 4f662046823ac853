"""The benchmark cases of bench/run.py, one module each."""
