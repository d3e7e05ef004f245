"""What goes in and out of tinydiff: checkpoints (atomic save, safe load, the model rebuilt), crash-safe
files and run folders, Hugging Face folders, progress bars, and what every command line shares.
A wing: it imports the core, never the reverse."""
