"""The CPU kernels: C sources built for the machine that runs them (native_build), their ctypes
bindings, and the CPU attention that picks among them. The GPU path imports none of this."""
