# Both images of Sluice: `docker build --target manager .` and `docker build --target enforcer .`
# (make docker-build builds both as IMG and ENFORCER_IMG).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY internal/ internal/
COPY cmd/ cmd/
COPY controllers/ controllers/
COPY enforcer/ enforcer/
COPY webhook/ webhook/
ARG TARGETOS TARGETARCH
# The build context has no .git, so Go records no commit: --version and sluice_build_info take
# VERSION and COMMIT from here (make docker-build passes them).
ARG VERSION=unknown COMMIT=unknown
RUN ldflags="-s -X github.com/sluice-dev/sluice/internal/buildinfo.version=${VERSION} -X github.com/sluice-dev/sluice/internal/buildinfo.commit=${COMMIT}" && \
    CGO_ENABLED=0 GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH} go build -trimpath -ldflags="$ldflags" -o /out/manager ./cmd/manager && \
    CGO_ENABLED=0 GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH} go build -trimpath -ldflags="$ldflags" -o /out/enforcer ./cmd/enforcer

FROM gcr.io/distroless/static:nonroot AS enforcer
COPY --from=build /out/enforcer /enforcer
USER 65532:65532
ENTRYPOINT ["/enforcer"]

FROM gcr.io/distroless/static:nonroot AS manager
COPY --from=build /out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
