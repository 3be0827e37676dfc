"""Generated from protos/kvmesh/v1/*.proto by protos/generate.py; do not edit."""
