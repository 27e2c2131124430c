"""The admin REST API: authenticated HDF5 weight uploads, persistent rounds, aggregation, downloads.

Import `create_app` from `server.admin.app` and `AdminSettings` from `server.admin.config`.
This package imports nothing at package level so the upload sandbox's worker processes, which
import `server.admin.inspect_worker`, stay light (h5py and numpy only, no FastAPI, no torch).
"""
