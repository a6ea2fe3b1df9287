"""Tools that read a run directory: its report page (report), its episodes as ATIF
trajectories (atif), whether two runs agree (compare), its policy as a Hugging Face
directory (export), its checkpoints scored on multiple-choice probes (probe)."""
