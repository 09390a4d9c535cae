package node

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/sluice-dev/sluice/internal/test/image"
	"github.com/sluice-dev/sluice/internal/test/local"
	"github.com/sluice-dev/sluice/internal/test/testenv"
)

// PauseImage is the pod sandbox's image, built from ./pause: Kubernetes's own cannot be pulled
// here.
const PauseImage = "sluice.test/pause:1"

// importPause builds the pause program and imports its image.
func (c *Cluster) importPause(ctx context.Context) error {
	tarball, err := ProgramImage(ctx, c.Dir, "./internal/test/node/pause", PauseImage)
	if err != nil {
		return err
	}
	return c.Import(ctx, tarball)
}

// ProgramImage builds the Go command pkg of the repository (such as ./internal/test/node/echo) as
// a static binary and makes an image of it under ref, on the base layer, run as the non-root
// user; it returns the image's tarball, written to dir.
func ProgramImage(ctx context.Context, dir, pkg, ref string) (string, error) {
	name := filepath.Base(pkg)
	bin := filepath.Join(dir, name)
	cmd := local.GoBuild(ctx, testenv.RepoRoot(), "-o", bin, pkg)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %w: %s", pkg, err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return "", err
	}
	base, err := image.BaseLayer()
	if err != nil {
		return "", err
	}
	img, err := image.New(v1.Config{Entrypoint: []string{"/" + name}, User: fmt.Sprintf("%d:%d", image.NonRoot, image.NonRoot)},
		base, []image.File{{Path: "/" + name, Data: data, Mode: 0o755}})
	if err != nil {
		return "", err
	}
	tarball := filepath.Join(dir, name+".tar")
	return tarball, image.Write(img, ref, tarball)
}

// RedisImage assembles an image of Debian's redis-server and redis-cli, with the libraries they
// load and the shell and cat that Sluice's readiness probe of a managed Redis runs, under ref.
// Its entrypoint is redis-server, which takes the arguments Sluice renders (a config file first),
// as the official image's entrypoint does.
func RedisImage(dir, ref string) (string, error) {
	files, err := image.FromHost("/usr/bin/redis-server", "/usr/bin/redis-cli", "/bin/sh", "/usr/bin/cat")
	if err != nil {
		return "", fmt.Errorf("the Redis image takes Debian's redis-server (apt-get install redis-server): %w", err)
	}
	base, err := image.BaseLayer()
	if err != nil {
		return "", err
	}
	img, err := image.New(v1.Config{
		Entrypoint: []string{"/usr/bin/redis-server"},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		User:       fmt.Sprintf("%d:%d", image.NonRoot, image.NonRoot),
		WorkingDir: "/tmp",
	}, base, files)
	if err != nil {
		return "", err
	}
	tarball := filepath.Join(dir, "redis.tar")
	return tarball, image.Write(img, ref, tarball)
}
