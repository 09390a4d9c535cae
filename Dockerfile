# Both images of Sluice: `docker build --target manager .` and `docker build --target enforcer .`
# (make docker-build builds both as IMG and ENFORCER_IMG; the release workflow builds them for
# linux/amd64 and linux/arm64).
#
# The tests build exactly what this file builds, without a Docker engine (internal/test/image):
# they copy what the build stage COPYs into a directory that stands for its WORKDIR, run its RUN
# lines there, and assemble the final stages from what they COPY. So the build stage writes its
# output under WORKDIR, and a package the binaries import that no COPY brings fails a test.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY api/ api/
COPY internal/ internal/
COPY cmd/ cmd/
COPY config/ config/
COPY controllers/ controllers/
COPY enforcer/ enforcer/
COPY webhook/ webhook/
ARG TARGETOS TARGETARCH
# The build context has no .git, so Go records no commit: --version and sluice_build_info take
# VERSION and COMMIT from here (make docker-build passes them). One go build for both binaries
# compiles the packages they share once.
ARG VERSION=unknown COMMIT=unknown
RUN ldflags="-s -X github.com/sluice-dev/sluice/internal/buildinfo.version=${VERSION} -X github.com/sluice-dev/sluice/internal/buildinfo.commit=${COMMIT}" && \
    CGO_ENABLED=0 GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH} go build -trimpath -ldflags="$ldflags" -o out/ ./cmd/manager ./cmd/enforcer

FROM gcr.io/distroless/static:nonroot AS enforcer
COPY --from=build /src/out/enforcer /enforcer
USER 65532:65532
ENTRYPOINT ["/enforcer"]

FROM gcr.io/distroless/static:nonroot AS manager
COPY --from=build /src/out/manager /manager
USER 65532:65532
ENTRYPOINT ["/manager"]
