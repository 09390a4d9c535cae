// Package node_test runs Sluice where users run it: its images, built by the Dockerfile's own
// steps, as pods on a real node (containerd, runc, a kubelet, kube-proxy, CoreDNS, the scheduler),
// installed by its Helm chart, reached through Service ClusterIPs. See internal/test/node.
package node_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/internal/test/image"
	"github.com/sluice-dev/sluice/internal/test/node"
	"github.com/sluice-dev/sluice/internal/test/testenv"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// The images the tests run, all imported into the node's containerd: Sluice's two under the
// chart's appVersion, and a second manager tag for an upgrade.
const (
	registry   = "sluice.test"
	echoImage  = registry + "/echo:1"
	redisImage = registry + "/redis:1"
	nextTag    = "-next"
)

var (
	cluster *node.Cluster
	k8s     client.Client
	// appVersion is the chart's appVersion, the tag of the images it installs.
	appVersion string
	helm       string
	work       string
)

func TestMain(m *testing.M) {
	flag.Parse()
	tier.RunFast(m)
	if !node.InNodeNetwork() {
		code, err := node.RunInNodeNetwork()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(code)
	}
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctrl.SetLogger(logr.Discard())
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	out, err := exec.Command(filepath.Join(testenv.RepoRoot(), "hack", "envtest.sh")).Output()
	if err != nil {
		return fail(fmt.Errorf("hack/envtest.sh: %w", err))
	}
	bin := strings.TrimSpace(string(out))
	helm = filepath.Join(bin, "helm")
	if appVersion, err = chartAppVersion(); err != nil {
		return fail(err)
	}
	if work, err = os.MkdirTemp("", "sluice-node-test-"); err != nil {
		return fail(err)
	}
	defer func() { _ = os.RemoveAll(work) }()
	// The images build while the cluster starts.
	images := make(chan error, 1)
	var tarballs []string
	go func() {
		var err error
		tarballs, err = buildImages(ctx)
		images <- err
	}()
	if cluster, err = node.Start(ctx, bin); err != nil {
		if ierr := <-images; ierr != nil {
			err = errors.Join(err, ierr)
		}
		return fail(err)
	}
	defer func() {
		if err := cluster.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
	}()
	if err := <-images; err != nil {
		return fail(err)
	}
	if err := cluster.Import(ctx, tarballs...); err != nil {
		return fail(err)
	}
	scheme := clientgoscheme.Scheme
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return fail(err)
	}
	if k8s, err = client.New(cluster.Config, client.Options{Scheme: scheme}); err != nil {
		return fail(err)
	}
	code := m.Run()
	if code != 0 {
		fmt.Fprintln(os.Stderr, cluster.Logs())
	}
	return code
}

// buildImages builds Sluice's images from the Dockerfile (the manager twice, under the chart's
// appVersion and a next tag for an upgrade), the Redis image and the upstream's, and returns
// their tarballs.
func buildImages(ctx context.Context) ([]string, error) {
	images, err := image.Build(ctx, image.Options{
		Dockerfile: filepath.Join(testenv.RepoRoot(), "Dockerfile"),
		Dir:        work,
		Args:       map[string]string{"VERSION": appVersion, "COMMIT": "node-tier"},
	}, registry, appVersion)
	if err != nil {
		return nil, err
	}
	var tarballs []string
	for _, img := range images {
		tarballs = append(tarballs, img.Tarball)
		if img.Target == "manager" {
			next := filepath.Join(work, "manager-next.tar")
			if err := image.Write(img.Image, registry+"/sluice-manager:"+appVersion+nextTag, next); err != nil {
				return nil, err
			}
			tarballs = append(tarballs, next)
		}
	}
	redis, err := node.RedisImage(work, redisImage)
	if err != nil {
		return nil, err
	}
	echo, err := node.ProgramImage(ctx, work, "./internal/test/node/echo", echoImage)
	if err != nil {
		return nil, err
	}
	return append(tarballs, redis, echo), nil
}

// chartAppVersion reads the chart's appVersion.
func chartAppVersion() (string, error) {
	data, err := os.ReadFile(filepath.Join(testenv.RepoRoot(), "charts", "sluice", "Chart.yaml"))
	if err != nil {
		return "", err
	}
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(data, &chart); err != nil {
		return "", err
	}
	if chart.AppVersion == "" || chart.AppVersion == "latest" {
		return "", fmt.Errorf("charts/sluice/Chart.yaml: appVersion %q is not a version: it is the images' tag", chart.AppVersion)
	}
	return chart.AppVersion, nil
}
