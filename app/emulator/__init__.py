"""An emulated SGLang worker serving moonshotai/Kimi-K2.5 with DFLASH speculative decoding.

The embedded default backend of ``dflash-gateway serve`` and the test double for the gateway:
SGLang's HTTP surface and response shapes, DFLASH verify-step emission calibrated to the seed's
acceptance lengths, capacity and queueing, a prefix cache, faults, a stream gate and ground truth.
Start it with ``dflash-gateway emulate`` (see ``app/emulator/cli.py``) or build it in-process with
``app.emulator.app.create_emulator_app``.
"""
