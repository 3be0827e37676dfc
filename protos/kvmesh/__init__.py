"""Generated gRPC modules; see protos/generate.py."""
