"""moto's server (`moto_server`), serving one request at a time.

`moto_server` serves requests on threads, and its DynamoDB backend is not safe for that:
concurrent writes to one table fail with `RuntimeError: dictionary changed size during
iteration` (an HTTP 500). The same application run by werkzeug without threads answers each
request whole before the next, so racing clients see the compare-and-swap semantics they
would on AWS. Usage: python moto-serial.py HOST PORT
"""

import sys

from werkzeug.serving import run_simple

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)

if __name__ == "__main__":
    host, port = sys.argv[1], int(sys.argv[2])
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, app, threaded=False, request_handler=MotoRequestHandler)
