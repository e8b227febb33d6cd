"""``fusepass demo``: a W8A8 Llama-style decoder, compiled with fusepass, reported on."""
