"""SGLang's wire formats, shared by the gateway, the policies and the simulator.

Everything here is a pure function or a msgspec struct: no I/O, so both sides of the
wire (engine and router) import the same definitions and cannot drift apart.
"""
