"""``torchmem devices``: every visible GPU's memory, host RAM, and the CPU meter."""

from __future__ import annotations

import argparse
import dataclasses
import json

from torchmem.cli.command import Command


class DevicesCommand(Command):
    name = "devices"
    help = "memory of every visible GPU and of this machine"
    description = (
        "Total, used and free memory of every GPU visible to PyTorch (whole device, all "
        "processes), this process's allocator share, host RAM, and which backend counts"
        " CPU tensors."
    )

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON (sizes in bytes)")

    def run(self, args: argparse.Namespace) -> int:
        from torchmem.devices import cpu_info, gpu_info, ram_info
        from torchmem.render import devices

        gpus, ram, cpu = gpu_info(), ram_info(), cpu_info()
        if args.json:
            data = {
                "gpus": [dataclasses.asdict(g) for g in gpus],
                "ram": dataclasses.asdict(ram),
                "cpu": dataclasses.asdict(cpu),
            }
            print(json.dumps(data, indent=2))
        else:
            print(devices.text(gpus, ram, cpu))
        return 0
