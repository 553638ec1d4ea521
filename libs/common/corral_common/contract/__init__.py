"""The v1 bus contract as code: every subject, request, reply and event.

Services and the SDK encode and decode only through these modules; `corral contract` generates the
JSON Schemas and the AsyncAPI document under docs/ from them, so the documented contract is the
one the code speaks.
"""
