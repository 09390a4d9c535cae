# Sluice: a Kubernetes operator for distributed rate limiting.
# `make test` runs every test; `make help` lists the targets.

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec

# Tools are pinned in hack/tools/go.mod and run with `go tool`; nothing is downloaded outside the Go
# module proxy.
TOOL := go tool -modfile=hack/tools/go.mod
CONTROLLER_GEN := $(TOOL) controller-gen
GOLANGCI_LINT := $(TOOL) golangci-lint
KUSTOMIZE := $(TOOL) kustomize
CRD_REF_DOCS := $(TOOL) crd-ref-docs

# The release this checkout is: the chart's appVersion, the tag of both images, in the chart, in
# dist/install.yaml and in the manager's default enforcer image alike (a test checks they agree).
RELEASE := $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/sluice/Chart.yaml)
IMG ?= ghcr.io/sluice-dev/sluice-manager:$(RELEASE)
# What --version and sluice_build_info report of the binaries and images built here.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
LDFLAGS := -X github.com/sluice-dev/sluice/internal/buildinfo.version=$(VERSION) -X github.com/sluice-dev/sluice/internal/buildinfo.commit=$(COMMIT)
ENFORCER_IMG ?= ghcr.io/sluice-dev/sluice-enforcer:$(RELEASE)
# The platforms of the released images (make docker-buildx).
PLATFORMS ?= linux/amd64,linux/arm64

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} /^[a-zA-Z_-]+:.*?##/ { printf "  %-14s %s\n", $$1, $$2 } /^##@/ { printf "\n%s\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development

.PHONY: generate
generate: ## Generate deepcopy functions.
	$(CONTROLLER_GEN) object:headerFile=hack/boilerplate.go.txt paths=./api/...

.PHONY: manifests
manifests: ## Generate the CRD, RBAC and webhook manifests from markers.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd webhook paths=./... \
		output:crd:artifacts:config=config/crd/bases \
		output:rbac:artifacts:config=config/rbac \
		output:webhook:artifacts:config=config/webhook
	@# The Helm chart installs config/'s generated objects, its alerts and dashboard, from copies.
	cp config/crd/bases/ratelimit.sluice.dev_ratelimitpolicies.yaml charts/sluice/files/crd.yaml
	cp config/crd/bases/ratelimit.sluice.dev_enforcerpools.yaml charts/sluice/files/crd-enforcerpools.yaml
	cp config/rbac/role.yaml config/rbac/leader_election_role.yaml charts/sluice/files/
	cp config/rbac/ratelimitpolicy_editor_role.yaml config/rbac/ratelimitpolicy_viewer_role.yaml charts/sluice/files/
	cp config/rbac/enforcerpool_editor_role.yaml config/rbac/enforcerpool_viewer_role.yaml charts/sluice/files/
	cp config/webhook/manifests.yaml charts/sluice/files/webhook.yaml
	cp config/prometheus/prometheusrule.yaml config/grafana/sluice.json charts/sluice/files/

.PHONY: docs
docs: ## Generate the API reference, docs/api.md, from the API's Go comments.
	$(CRD_REF_DOCS) --source-path=./api --config=docs/crd-ref-docs.yaml --renderer=markdown \
		--output-path=docs/api.md --log-level=WARN

.PHONY: fmt
fmt: ## Format the Go code.
	go fmt ./...

.PHONY: vet
vet: ## Vet the Go code.
	go vet ./...

.PHONY: lint
lint: ## Lint the Go code with the pinned golangci-lint.
	$(GOLANGCI_LINT) run ./...

.PHONY: build-installer
build-installer: manifests ## Generate dist/install.yaml, what `kubectl apply -f` installs: config/default with the release's images.
	@mkdir -p dist
	$(KUSTOMIZE) build config/default > dist/install.yaml

.PHONY: verify
verify: generate manifests docs build-installer ## Regenerate everything, fail if anything generated drifted, go.mod is untidy or a kustomization is broken.
	@for overlay in config/default config/cert-manager config/prometheus; do \
		$(KUSTOMIZE) build $$overlay >/dev/null || { echo "kustomize build $$overlay failed"; exit 1; }; \
	done
	@drift=$$(git status --porcelain -- api config/crd config/rbac config/webhook charts/sluice/files docs/api.md dist); \
	if [[ -n "$$drift" ]]; then \
		echo "Generated files are out of date; run 'make generate manifests docs build-installer' and commit:"; \
		echo "$$drift"; git --no-pager diff --stat -- api config docs/api.md; exit 1; \
	fi
	@go mod tidy -diff >/dev/null || { echo "go.mod or go.sum is not tidy; run 'go mod tidy' and commit:"; go mod tidy -diff; exit 1; }

##@ Run

.PHONY: demo
demo: ## Run Sluice on this machine, no cluster needed: control plane, Redis, manager, a policy, an enforcer, traffic.
	@hack/ensure-packages.sh redis-server redis-cli
	go build -o bin/sluice-demo ./hack/demo
	KUBEBUILDER_ASSETS="$$(hack/envtest.sh)" bin/sluice-demo

##@ Test

.PHONY: packages
packages: ## Make sure the Debian packages the tests run exist: redis, nginx, containerd, runc, CNI plugins, iptables (one apt-get when root).
	@hack/ensure-packages.sh

.PHONY: tools
tools: ## Build helm, promtool and traefik once per machine (the tests run them on the chart, the alerts and the Gateway API); print their paths.
	@hack/tool.sh helm
	@hack/tool.sh promtool
	@hack/tool.sh traefik

.PHONY: envtest
envtest: ## Build the test control plane (kube-apiserver, etcd) once per machine; print its path.
	@hack/envtest.sh

.PHONY: test-unit
test-unit: ## Run the fast tier: every test that needs neither the control plane, nor redis-server, nor a built binary.
	go test -short -count=1 ./...

.PHONY: test
test: packages ## Run all tests against a real API server, a real node (kubelet, containerd, kube-proxy), real Redis, nginx and Traefik.
	KUBEBUILDER_ASSETS="$$(hack/envtest.sh)" HELM="$$(hack/tool.sh helm)" PROMTOOL="$$(hack/tool.sh promtool)" \
		go test -race -count=1 -timeout 30m ./...

# FUZZTIME is how long `make fuzz` runs each fuzz target.
FUZZTIME ?= 20s

.PHONY: fuzz
fuzz: packages ## Run every fuzz target of the repository for FUZZTIME each, default 20s, one instrumented test binary a package (hack/fuzz.sh); a crash is written to the target's testdata/fuzz/ and fails the run.
	@hack/fuzz.sh $(FUZZTIME)

.PHONY: bench
bench: packages ## Run the Go benchmarks, and the thousand-policy tests of the benchmark tier (-tags bench).
	go test -run '^$$' -bench . -benchmem ./...
	go test -tags bench -count=1 -run Thousand -timeout 60m ./test/e2e/

##@ Build

.PHONY: build
build: ## Build bin/manager and bin/enforcer.
	go build -ldflags '$(LDFLAGS)' -o bin/manager ./cmd/manager
	go build -ldflags '$(LDFLAGS)' -o bin/enforcer ./cmd/enforcer

.PHONY: docker-build
docker-build: ## Build the images IMG (manager) and ENFORCER_IMG from the Dockerfile.
	docker build --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --target manager -t $(IMG) .
	docker build --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --target enforcer -t $(ENFORCER_IMG) .

.PHONY: docker-push
docker-push: ## Push the images IMG and ENFORCER_IMG.
	docker push $(IMG)
	docker push $(ENFORCER_IMG)

##@ Release (.github/workflows/release.yaml runs these for a tag; test/release runs them here)

.PHONY: release-check
release-check: ## Fail unless RELEASE_TAG (the pushed tag) is the chart's appVersion, which the images are tagged with.
	@[[ "$(RELEASE_TAG)" == "$(RELEASE)" ]] || { echo "tag $(RELEASE_TAG) is not the chart's appVersion $(RELEASE): set appVersion in charts/sluice/Chart.yaml (and make build-installer) before tagging"; exit 1; }

.PHONY: docker-buildx
docker-buildx: ## Build and push IMG and ENFORCER_IMG for PLATFORMS with docker buildx.
	docker buildx build --push --platform $(PLATFORMS) --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --target manager -t $(IMG) .
	docker buildx build --push --platform $(PLATFORMS) --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --target enforcer -t $(ENFORCER_IMG) .

# DIST is where chart-package writes the chart.
DIST ?= dist

.PHONY: chart-package
chart-package: ## Package the chart into $(DIST)/sluice-<version>.tgz, which helm push sends to an OCI registry.
	@mkdir -p $(DIST)
	"$$(hack/tool.sh helm)" package charts/sluice --destination $(DIST)

.PHONY: run
run: ## Run the manager against the cluster of the current kubeconfig.
	go run ./cmd/manager

##@ Deployment

.PHONY: install
install: manifests ## Install the CRD into the cluster of the current kubeconfig.
	$(KUSTOMIZE) build config/crd | kubectl apply --server-side -f -

# OVERLAY=config/cert-manager has cert-manager issue the webhook certificate instead of the manager.
OVERLAY ?= config/default

.PHONY: deploy
deploy: manifests ## Deploy the manager with images IMG and ENFORCER_IMG into the cluster of the current kubeconfig.
	$(KUSTOMIZE) build $(OVERLAY) | sed -e 's|ghcr.io/sluice-dev/sluice-manager:$(RELEASE)|$(IMG)|' -e 's|ghcr.io/sluice-dev/sluice-enforcer:$(RELEASE)|$(ENFORCER_IMG)|' | kubectl apply --server-side -f -

.PHONY: undeploy
undeploy: ## Remove what deploy installed (policies first, so their enforcers are collected).
	-kubectl delete ratelimitpolicies --all --all-namespaces --wait
	$(KUSTOMIZE) build $(OVERLAY) | kubectl delete --ignore-not-found -f -
