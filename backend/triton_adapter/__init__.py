"""Triton python-backend adapter: what each model.py in model_repository/ delegates to.

`pb_utils` (triton_python_backend_utils) is never imported here; each model takes
it as a constructor argument, so the package imports and is tested without a server.
"""
