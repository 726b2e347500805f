"""Analysis and reporting: comparing runs, per-stage times, llama.cpp's KLD, the fuzz report, timing."""
