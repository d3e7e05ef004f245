"""Research variants, one file each, built from the core's pieces: sampled DDTree trees, DSpark's
Markov head, DFlash's rejection rule and verify length, self-speculation, an AR draft for the
diffusion LM, distillation, regenerated training text, soft labels, QAT, the AR MoE target.
A wing: it imports the core, never the reverse."""
