"""Conversions between the core's types and kvtierd.v1 messages, shared by the server and the client."""
