"""Quality experiments, ablation drivers and sweeps: what a change does to the error or the KLD, and why."""
