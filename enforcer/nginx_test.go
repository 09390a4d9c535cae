package enforcer_test

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/enforcer/internal/store"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// ingressNginx is nginx configured as ingress-nginx renders an Ingress with the auth-url and
// auth-response-headers annotations (its external-auth location and auth_request), in four
// servers:
//   - snippets: plus the configuration-snippet and server-snippet of docs/enforcer.md, with
//     auth-url pointing at the check API's /auth-request;
//   - annotations: the annotations alone, auth-url at /auth-request;
//   - proxy: the Ingress routed to the enforcer's proxy port instead of the upstream;
//   - closed: the snippets' 503 path, in front of an enforcer whose Redis is down.
const ingressNginx = `
worker_processes 1;
error_log {{dir}}/error.log;
pid {{dir}}/nginx.pid;
events { worker_connections 256; }
http {
  access_log off;
  client_body_temp_path {{dir}}/body;
  proxy_temp_path {{dir}}/proxy;
  fastcgi_temp_path {{dir}}/fastcgi;
  uwsgi_temp_path {{dir}}/uwsgi;
  scgi_temp_path {{dir}}/scgi;

  server {
    listen 127.0.0.1:{{snippets}};
    # server-snippet
    location @sluice_429 {
      add_header Retry-After $sluice_retry_after always;
      add_header RateLimit $sluice_ratelimit always;
      add_header RateLimit-Policy $sluice_ratelimit_policy always;
      default_type application/problem+json;
      return 429 '{"type":"https://sluice.dev/problems/rate-limited","title":"Too Many Requests","status":429}\n';
    }
    location @sluice_503 {
      add_header Retry-After $sluice_retry_after always;
      default_type application/problem+json;
      return 503 '{"type":"https://sluice.dev/problems/store-unavailable","title":"Service Unavailable","status":503}\n';
    }
    {{auth "{{check}}/auth-request"}}
    location / {
      auth_request /_external-auth;
      auth_request_set $authHeader0 $upstream_http_ratelimit_policy;
      proxy_set_header 'RateLimit-Policy' $authHeader0;
      # configuration-snippet
      auth_request_set $sluice_ratelimit $upstream_http_ratelimit;
      auth_request_set $sluice_ratelimit_policy $upstream_http_ratelimit_policy;
      auth_request_set $sluice_retry_after $upstream_http_retry_after;
      add_header RateLimit $sluice_ratelimit always;
      add_header RateLimit-Policy $sluice_ratelimit_policy always;
      error_page 403 = @sluice_429;
      error_page 401 = @sluice_503;
      proxy_pass {{upstream}};
    }
  }

  server {
    listen 127.0.0.1:{{annotations}};
    {{auth "{{check}}/auth-request"}}
    location / {
      auth_request /_external-auth;
      auth_request_set $authHeader0 $upstream_http_ratelimit_policy;
      proxy_set_header 'RateLimit-Policy' $authHeader0;
      proxy_pass {{upstream}};
    }
  }

  server {
    listen 127.0.0.1:{{closed}};
    # the snippets' server, with auth-url at an enforcer whose Redis is down
    location @sluice_503 {
      add_header Retry-After $sluice_retry_after always;
      default_type application/problem+json;
      return 503 '{"type":"https://sluice.dev/problems/store-unavailable","title":"Service Unavailable","status":503}\n';
    }
    {{auth "{{closedcheck}}/auth-request"}}
    location / {
      auth_request /_external-auth;
      auth_request_set $sluice_retry_after $upstream_http_retry_after;
      error_page 401 = @sluice_503;
      proxy_pass {{upstream}};
    }
  }

  server {
    listen 127.0.0.1:{{proxy}};
    location / {
      proxy_set_header X-Forwarded-For $remote_addr;
      proxy_pass {{enforcer}};
    }
  }
}
`

// authLocation is ingress-nginx's external-auth location for an auth-url.
const authLocation = `location = /_external-auth {
      internal;
      proxy_pass_request_body off;
      proxy_set_header Content-Length "";
      proxy_set_header X-Forwarded-Proto "";
      proxy_set_header X-Original-URL $scheme://$http_host$request_uri;
      proxy_set_header X-Original-Method $request_method;
      proxy_set_header X-Sent-From "nginx-ingress-controller";
      proxy_set_header X-Real-IP $remote_addr;
      proxy_set_header X-Forwarded-For $remote_addr;
      proxy_set_header X-Auth-Request-Redirect $request_uri;
      proxy_http_version 1.1;
      proxy_pass %s;
    }`

// rawStatus sends one raw request on a connection of its own and returns the status.
func rawStatus(t *testing.T, addr, request string) int {
	t.Helper()
	status, err := local.RawStatus(addr, request)
	if err != nil {
		t.Fatal(err)
	}
	return status
}

// startNginx runs the real nginx with a configuration until the test ends.
func startNginx(t *testing.T, conf string) {
	t.Helper()
	tier.Needs(t, "nginx")
	dir := t.TempDir()
	out := &local.Output{}
	p, err := local.Nginx(out, dir, strings.ReplaceAll(conf, "{{dir}}", dir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			log, _ := os.ReadFile(filepath.Join(dir, "error.log"))
			t.Logf("nginx: %s\nerror.log:\n%s", out, log)
		}
	})
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
}

// Through the real nginx, configured as ingress-nginx renders auth-url: with the documented
// snippets a refusal reaches the client as 429 with Retry-After and the RateLimit fields, and an
// allowed request reaches the upstream and the client gets the fields; with the annotations
// alone, a refusal is a 403; and with the Ingress routed to the enforcer's proxy, refusals are
// 429 with everything, no snippet needed. A Host whose port does not parse is decided on the
// path the upstream reads, like any other.
func TestNginxWhenConfiguredAsIngressNginxRendersAuthURLThenRefusalsReachClientsAs429(t *testing.T) {
	up := newUpstream(t)
	e := start(t, policyDoc("nginx", `    - name: per-client
      key: [{type: Header, name: X-Client}]
      fixedWindow: {limit: 2, window: 1h}
`, "  trustedProxies: [\"127.0.0.0/8\"]\n"), up, nil)
	// An enforcer whose Redis is down, with a rule that fails closed.
	dead := freePort(t)
	closed := start(t, policyDoc("nginx-closed", `    - name: payments
      fixedWindow: {limit: 10, window: 1h}
      failureMode: Closed
`), up, &store.RedisOptions{Addrs: []string{"127.0.0.1:" + dead}, Timeout: 50 * time.Millisecond})
	ports := map[string]string{"snippets": freePort(t), "annotations": freePort(t), "proxy": freePort(t), "closed": freePort(t)}
	conf := ingressNginx
	conf = strings.ReplaceAll(conf, `{{auth "{{closedcheck}}/auth-request"}}`, fmt.Sprintf(authLocation, closed.check+"/auth-request"))
	conf = strings.ReplaceAll(conf, `{{auth "{{check}}/auth-request"}}`, fmt.Sprintf(authLocation, e.check+"/auth-request"))
	conf = strings.ReplaceAll(conf, "{{upstream}}", up.URL)
	conf = strings.ReplaceAll(conf, "{{enforcer}}", e.proxy)
	for name, port := range ports {
		conf = strings.ReplaceAll(conf, "{{"+name+"}}", port)
	}
	startNginx(t, conf)
	waitUntil(t, "nginx listens", func() bool {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+ports["proxy"], 100*time.Millisecond)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	})

	send := func(server, client string) reply {
		return get(t, "http://127.0.0.1:"+ports[server]+"/orders", "X-Client", client)
	}
	for server, refused := range map[string]int{"snippets": 429, "annotations": 403, "proxy": 429} {
		client := "client-" + server
		hits := up.hits.Load()
		for i := range 2 {
			r := send(server, client)
			if r.StatusCode != http.StatusOK {
				t.Errorf("%s: request %d: %d, want 200", server, i, r.StatusCode)
			}
			if wantFields := server == "snippets" || server == "proxy"; wantFields && (r.Header.Get("RateLimit") == "" || r.Header.Get("RateLimit-Policy") == "") {
				t.Errorf("%s: allowed request %d without the RateLimit fields: %v", server, i, r.Header)
			}
		}
		if got := up.hits.Load() - hits; got != 2 {
			t.Errorf("%s: the upstream saw %d of the 2 allowed requests", server, got)
		}
		r := send(server, client)
		if r.StatusCode != refused {
			t.Errorf("%s: the refusal reached the client as %d, want %d", server, r.StatusCode, refused)
		}
		if refused == 429 {
			ra, err := strconv.Atoi(r.Header.Get("Retry-After"))
			if err != nil || ra < 1 || r.Header.Get("RateLimit") == "" || r.Header.Get("RateLimit-Policy") == "" {
				t.Errorf("%s: the 429 carries Retry-After %q, RateLimit %q, RateLimit-Policy %q", server,
					r.Header.Get("Retry-After"), r.Header.Get("RateLimit"), r.Header.Get("RateLimit-Policy"))
			}
		}
		if got := up.hits.Load() - hits; got != 2 {
			t.Errorf("%s: the refused request reached the upstream", server)
		}
	}
	// nginx passes a Host whose port is not a number on in X-Original-URL: the decision is on the
	// path all the same, so the client that sends one is limited like any other.
	hits := up.hits.Load()
	for i, want := range []int{200, 200, 403} {
		if got := rawStatus(t, "127.0.0.1:"+ports["annotations"], "GET /orders HTTP/1.1\r\nHost: shop.example:notaport\r\nX-Client: bad-host\r\nConnection: close\r\n\r\n"); got != want {
			t.Errorf("Host with an unparseable port, request %d: %d, want %d", i, got, want)
		}
	}
	if got := up.hits.Load() - hits; got != 2 {
		t.Errorf("the upstream saw %d requests of the client with the odd Host, want 2", got)
	}
	// A fail-closed rule whose store cannot answer: 503 with Retry-After, not 500.
	hits = up.hits.Load()
	if r := send("closed", "anyone"); r.StatusCode != http.StatusServiceUnavailable || r.Header.Get("Retry-After") == "" {
		t.Errorf("the store failure reached the client as %d, Retry-After %q; want 503 with Retry-After", r.StatusCode, r.Header.Get("Retry-After"))
	}
	if up.hits.Load() != hits {
		t.Error("the request refused for the store's failure reached the upstream")
	}
}
