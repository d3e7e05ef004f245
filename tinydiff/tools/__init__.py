"""Tools around a trained model: the pinned evaluation, the quality judge, export to and import from
Hugging Face, FP4 quantization. A wing: it imports the core, never the reverse."""
