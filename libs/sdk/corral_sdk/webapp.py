"""A small web app and the Chromium that drives it, both inside one `browser` sandbox: what a
web agent's task looks like (tests/integration/test_browser.py, the demo's web environment).

The app is a one-page shop: a form (name, quantity) posts an order, the server appends it to
ORDERS_PATH and answers a confirmation whose total the page's own JavaScript writes, so only a
real browser (not an HTTP client) sees the whole page. Chromium listens for the DevTools
protocol on the sandbox's loopback (DEVTOOLS_PORT); a client outside reaches it only through a
port forward over the bus (`sb.forward(DEVTOOLS_PORT)`)."""
from __future__ import annotations

APP_PORT = 8000
DEVTOOLS_PORT = 9222
APP_PATH = "/srv/app/app.py"
ORDERS_PATH = "/srv/app/state/orders.jsonl"  # the app's state: the one file it writes
PRICE_EUR = 7

# headless, no GPU, no /dev/shm use (small in a sandbox), no background traffic (the sandbox has
# no network: every attempt would be an audited connect; without the proxy and the resolver rules
# Chromium looks names up all the time), DevTools on loopback only. Arguments, not shell words:
# join them with shlex.join
CHROMIUM_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps", "--metrics-recording-only",
    "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--disable-features=DnsOverHttps",
    "--user-data-dir=/tmp/chromium", f"--remote-debugging-port={DEVTOOLS_PORT}",
    "--remote-debugging-address=127.0.0.1", "about:blank",
)

APP_SOURCE = r'''
import html, json, os, socketserver, threading, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ORDERS = "%(orders)s"
PRICE = %(price)d
LOCK = threading.Lock()
FORM = """<!doctype html><html><head><title>Widget shop</title></head><body>
<h1>Order widgets</h1>
<form method="post" action="/order">
<label>Name <input id="name" name="name" required></label>
<label>Quantity <input id="qty" name="qty" type="number" min="1" max="99" required></label>
<button id="submit" type="submit">Place order</button>
</form></body></html>"""
DONE = """<!doctype html><html><head><title>Order placed</title></head><body>
<p id="result">Order #%%d: %%d widget(s) for %%s</p><p id="total-slot"></p>
<script>
const p = document.createElement("p"); p.id = "total";
p.textContent = "Total: " + (%%d * PRICE) + " EUR";
document.getElementById("total-slot").appendChild(p);
</script></body></html>""".replace("PRICE", str(PRICE))


class Handler(BaseHTTPRequestHandler):
    def send(self, code, body):
        raw = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        self.send(200, FORM) if self.path == "/" else self.send(404, "no such page")

    def do_POST(self):
        if self.path != "/order":
            return self.send(404, "no such page")
        form = urllib.parse.parse_qs(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
        name = form.get("name", [""])[0].strip()
        try:
            qty = int(form.get("qty", [""])[0])
        except ValueError:
            qty = 0
        if not name or not 1 <= qty <= 99:
            return self.send(400, "a name and a quantity from 1 to 99, please")
        with LOCK:
            n = sum(1 for _ in open(ORDERS)) + 1
            with open(ORDERS, "a") as f:
                f.write(json.dumps({"id": n, "name": name, "qty": qty}) + "\n")
        self.send(200, DONE %% (n, qty, html.escape(name), qty))

    def log_message(self, *args):
        pass


# the state file exists from the start, made by whoever runs the app (the harness, in the web
# environment): nobody else can then create it, or write it unless its owner lets them
os.makedirs(os.path.dirname(ORDERS), exist_ok=True)
open(ORDERS, "a").close()
class Server(ThreadingHTTPServer):
    def server_bind(self):  # HTTPServer's own asks DNS for this host's name (getfqdn): no lookups here
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


Server(("127.0.0.1", %(port)d), Handler).serve_forever()
''' % {"orders": ORDERS_PATH, "price": PRICE_EUR, "port": APP_PORT}
