"""The gin job's parts that `speclm.run` composes (the job layer: the only gin users)."""
