from torchmem.cli import run

run()
