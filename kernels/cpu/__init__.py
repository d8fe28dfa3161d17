"""C++ CPU kernels (one .cpp and one thin wrapper .py per kernel; extension.py builds them) and the decoder stack
that runs a whole small-batch CPU step in one call (decoder_stack.py). Each kernel's torch twin in kernels/ stays
its oracle."""
