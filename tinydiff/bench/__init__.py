"""The measuring tools, above the library: `python -m tinydiff.bench` (table.py: every decoding method
on the same prompts, one table), its method runners (methods.py), what they share (measure.py) and
`--report DIR` (report.py: train what is missing, run all, write DIR/RESULTS.md), tinydiff against
transformers (hf.py), and the quality tool, `python -m tinydiff.bench.quality` (quality.py, its curve in
curve.py). They call library functions and never an entry-point script."""
