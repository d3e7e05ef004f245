"""What train.py calls: the run's settings, the model it trains, precision, data parallelism and the
optimizer. A wing: it imports the core, never the reverse."""
