"""Speed benchmarks: each times our code against a baseline measured in the same run and prints the ratio.

Every script's defaults finish in minutes on a 2-core CPU (`make bench` runs them all); real sizes take flags.
"""
