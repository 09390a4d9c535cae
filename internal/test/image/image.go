// Package image builds Sluice's images the way its Dockerfile does, with no Docker engine: it
// parses the Dockerfile with BuildKit's own parser, copies exactly what the build stage COPYs
// (less what .dockerignore leaves out) into a directory that stands for the stage's WORKDIR,
// runs the stage's RUN lines there, and assembles each final stage from what it COPYs from the
// build stage, with its USER and ENTRYPOINT, as an image tarball that containerd imports.
//
// go-containerregistry assembles the images: a library, so the tests need no daemon, no root
// and no registry; buildah would need a storage configuration and root, and ko builds the
// binaries itself rather than by the Dockerfile's steps. What the final stages take FROM
// (distroless, which cannot be pulled here) is stood in for by a base layer with the files a
// static binary reads from it: the non-root user's passwd and group entries, /tmp and the CA
// certificates.
package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// Options are the build's arguments.
type Options struct {
	// Dockerfile is the Dockerfile's path; its directory is the build context.
	Dockerfile string
	// Dir receives the build context and the image tarballs.
	Dir string
	// Args are --build-arg values (VERSION, COMMIT); TARGETOS and TARGETARCH default to linux
	// and this machine's architecture, as a Docker build for the local platform gives them.
	Args map[string]string
	// Env is added to the environment of the RUN lines (GOFLAGS, GOCACHE...).
	Env []string
	// Log receives the RUN lines' output. Nil discards it.
	Log io.Writer
}

// Image is one final stage, assembled.
type Image struct {
	// Target is the stage's name (docker build --target).
	Target string
	// Image is the image; Tarball its file, tagged Ref, which `ctr images import` reads.
	Image   v1.Image
	Tarball string
	Ref     string
}

// Stages is a parsed Dockerfile: its build stage (the stage the others COPY --from) and its
// final stages.
type Stages struct {
	Build  instructions.Stage
	Finals []instructions.Stage
}

// Parse reads the Dockerfile at file with BuildKit's parser.
func Parse(file string) (*Stages, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	res, err := parser.Parse(f)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", file, err)
	}
	stages, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", file, err)
	}
	if len(stages) < 2 {
		return nil, fmt.Errorf("%s: want a build stage and final stages, found %d stages", file, len(stages))
	}
	return &Stages{Build: stages[0], Finals: stages[1:]}, nil
}

// Build runs the Dockerfile's build stage in a context of exactly what it copies, and assembles
// every final stage into Dir as an image tagged <repository prefix>/sluice-<target>:<tag>.
func Build(ctx context.Context, o Options, prefix, tag string) ([]Image, error) {
	st, err := Parse(o.Dockerfile)
	if err != nil {
		return nil, err
	}
	workdir, err := st.RunBuild(ctx, o)
	if err != nil {
		return nil, err
	}
	var images []Image
	arch := runtime.GOARCH
	if a := o.Args["TARGETARCH"]; a != "" {
		arch = a
	}
	for _, final := range st.Finals {
		img, err := Assemble(final, st.Build.Name, workdir, arch)
		if err != nil {
			return nil, err
		}
		ref := fmt.Sprintf("%s/sluice-%s:%s", prefix, final.Name, tag)
		file := filepath.Join(o.Dir, final.Name+".tar")
		if err := Write(img, ref, file); err != nil {
			return nil, err
		}
		images = append(images, Image{Target: final.Name, Image: img, Tarball: file, Ref: ref})
	}
	return images, nil
}

// RunBuild copies what the build stage COPYs from the context into o.Dir/context, which stands
// for the stage's WORKDIR, and runs its RUN lines there with its ARGs; it returns that directory.
func (s *Stages) RunBuild(ctx context.Context, o Options) (string, error) {
	contextDir := filepath.Dir(o.Dockerfile)
	ignore, err := dockerignore(contextDir)
	if err != nil {
		return "", err
	}
	work := filepath.Join(o.Dir, "context")
	if err := os.MkdirAll(work, 0o755); err != nil {
		return "", err
	}
	args := map[string]string{"TARGETOS": "linux", "TARGETARCH": runtime.GOARCH}
	env := []string{}
	for _, c := range s.Build.Commands {
		switch c := c.(type) {
		case *instructions.WorkdirCommand:
			// The directory stands for the WORKDIR: the Dockerfile has one.
		case *instructions.CopyCommand:
			if c.From != "" {
				return "", fmt.Errorf("build stage: %s: a COPY --from in the build stage is not supported", c)
			}
			for _, src := range c.SourcePaths {
				if err := copyIn(contextDir, src, work, c.DestPath, ignore); err != nil {
					return "", fmt.Errorf("build stage: %s: %w", c, err)
				}
			}
		case *instructions.ArgCommand:
			declare(args, c, o.Args)
		case *instructions.RunCommand:
			if err := run(ctx, work, c, append(slices.Clone(o.Env), env...), args, o.Log); err != nil {
				return "", err
			}
		case *instructions.EnvCommand:
			for _, kv := range c.Env {
				env = append(env, kv.Key+"="+kv.Value)
			}
		default:
			return "", fmt.Errorf("build stage: %s: not supported by the test build", c)
		}
	}
	return work, nil
}

// declare sets the ARGs c declares in args: the value given to the build, else one set before
// (TARGETOS, TARGETARCH), else the default c gives, else empty.
func declare(args map[string]string, c *instructions.ArgCommand, given map[string]string) {
	for _, a := range c.Args {
		v, ok := given[a.Key]
		if !ok {
			if _, set := args[a.Key]; set {
				continue
			}
			if a.Value != nil {
				v = *a.Value
			}
		}
		args[a.Key] = v
	}
}

// run runs one RUN line with sh in work, with the ARGs in its environment as Docker gives them.
func run(ctx context.Context, work string, c *instructions.RunCommand, env []string, args map[string]string, log io.Writer) error {
	if !c.PrependShell || len(c.CmdLine) != 1 {
		return fmt.Errorf("build stage: %s: only the shell form of RUN is supported", c)
	}
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", c.CmdLine[0])
	cmd.Dir = work
	cmd.Env = append(os.Environ(), env...)
	for k, v := range args {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if log != nil {
		cmd.Stdout, cmd.Stderr = io.MultiWriter(&out, log), io.MultiWriter(&out, log)
	}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("build stage: %s: %w\n%s", c, err, out.String())
	}
	return nil
}

// dockerignore reads the context's .dockerignore, if any.
func dockerignore(contextDir string) (*patternmatcher.PatternMatcher, error) {
	f, err := os.Open(filepath.Join(contextDir, ".dockerignore"))
	if errors.Is(err, fs.ErrNotExist) {
		return patternmatcher.New(nil)
	}
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("read .dockerignore: %w", err)
	}
	return patternmatcher.New(patterns)
}

// copyIn copies the context's src (a file or a directory, no wildcards) to dest in work as COPY
// does: a directory's contents into dest, a file into dest when dest ends in a slash. What
// .dockerignore matches is left out.
func copyIn(contextDir, src, work, destPath string, ignore *patternmatcher.PatternMatcher) error {
	dest := filepath.Join(work, destPath)
	if strings.ContainsAny(src, "*?[") {
		return fmt.Errorf("wildcards in COPY sources are not supported: %s", src)
	}
	root := filepath.Join(contextDir, filepath.Clean("/"+src))
	info, err := os.Stat(root)
	if err != nil {
		return err
	}
	if !info.IsDir() {
		if strings.HasSuffix(destPath, "/") || destPath == "." {
			dest = filepath.Join(dest, filepath.Base(root))
		}
		return copyFile(root, dest, info.Mode())
	}
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(contextDir, p)
		if err != nil {
			return err
		}
		if ignored, err := ignore.MatchesOrParentMatches(filepath.ToSlash(rel)); err != nil || ignored {
			if err == nil && d.IsDir() {
				return filepath.SkipDir
			}
			return err
		}
		inside, _ := filepath.Rel(root, p)
		target := filepath.Join(dest, inside)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			return nil
		}
		return copyFile(p, target, info.Mode())
	})
}

func copyFile(src, dest string, mode fs.FileMode) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(dest), 0o755); err != nil {
		return err
	}
	return os.WriteFile(dest, data, mode.Perm())
}

// Assemble makes the image of a final stage for the architecture arch: the base layer (see the
// package comment), then a layer of what the stage COPYs --from the build stage, whose WORKDIR
// workdir stands for, then its USER and ENTRYPOINT.
func Assemble(stage instructions.Stage, buildStage, workdir, arch string) (v1.Image, error) {
	var files []File
	cfg := v1.Config{Env: []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}}
	for _, c := range stage.Commands {
		switch c := c.(type) {
		case *instructions.CopyCommand:
			if c.From != buildStage || len(c.SourcePaths) != 1 {
				return nil, fmt.Errorf("stage %s: %s: only COPY --from=%s of one path is supported", stage.Name, c, buildStage)
			}
			local, err := inWorkdir(c.SourcePaths[0], workdir)
			if err != nil {
				return nil, fmt.Errorf("stage %s: %s: %w", stage.Name, c, err)
			}
			data, err := os.ReadFile(local)
			if err != nil {
				return nil, fmt.Errorf("stage %s: %s: %w", stage.Name, c, err)
			}
			files = append(files, File{Path: c.DestPath, Data: data, Mode: 0o755})
		case *instructions.UserCommand:
			cfg.User = c.User
		case *instructions.EntrypointCommand:
			if c.PrependShell {
				return nil, fmt.Errorf("stage %s: %s: only the exec form of ENTRYPOINT is supported", stage.Name, c)
			}
			cfg.Entrypoint = c.CmdLine
		default:
			return nil, fmt.Errorf("stage %s: %s: not supported by the test build", stage.Name, c)
		}
	}
	base, err := BaseLayer()
	if err != nil {
		return nil, err
	}
	return NewFor(arch, cfg, base, files)
}

// buildWorkdir is the build stage's WORKDIR, which the directory RunBuild returns stands for.
const buildWorkdir = "/src"

// inWorkdir maps a path of the build stage to the directory that stands for its WORKDIR.
func inWorkdir(p, workdir string) (string, error) {
	rel, ok := strings.CutPrefix(path.Clean(p), buildWorkdir+"/")
	if !ok {
		return "", fmt.Errorf("%s is outside the build stage's WORKDIR %s, which is all the test build stands for", p, buildWorkdir)
	}
	return filepath.Join(workdir, filepath.FromSlash(rel)), nil
}

// File is a file of an image layer.
type File struct {
	Path string
	Data []byte
	Mode int64
	// Link, when set, makes the entry a symbolic link to Link.
	Link string
	// UID owns the entry (and its group is the same number); 0 is root.
	UID int
}

// New makes an image of the base layer (nil for none), a layer of files, and cfg, for this
// machine's platform.
func New(cfg v1.Config, base v1.Layer, files []File) (v1.Image, error) {
	return NewFor(runtime.GOARCH, cfg, base, files)
}

// NewFor is New for linux on the architecture arch (a GOARCH).
func NewFor(arch string, cfg v1.Config, base v1.Layer, files []File) (v1.Image, error) {
	img := empty.Image
	var layers []v1.Layer
	if base != nil {
		layers = append(layers, base)
	}
	top, err := Layer(files)
	if err != nil {
		return nil, err
	}
	layers = append(layers, top)
	img, err = mutate.AppendLayers(img, layers...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", arch, cfg
	cf.Created = v1.Time{Time: time.Unix(0, 0)}
	return mutate.ConfigFile(img, cf)
}

// Layer makes an image layer of files, with their parent directories; every entry belongs to
// root, as a COPY without --chown gives it.
func Layer(files []File) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	for _, f := range files {
		name := strings.TrimPrefix(path.Clean("/"+f.Path), "/")
		for d := path.Dir(name); d != "." && !dirs[d]; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	sorted := make([]string, 0, len(dirs))
	for d := range dirs {
		sorted = append(sorted, d)
	}
	slices.Sort(sorted)
	for _, d := range sorted {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: time.Unix(0, 0)}); err != nil {
			return nil, err
		}
	}
	for _, f := range files {
		h := &tar.Header{Name: strings.TrimPrefix(path.Clean("/"+f.Path), "/"), Mode: f.Mode, Uid: f.UID, Gid: f.UID, ModTime: time.Unix(0, 0)}
		switch {
		case f.Link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.Link
		case f.Data == nil && f.Mode&int64(fs.ModeDir) != 0:
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", f.Mode&0o7777
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(f.Data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil })
}

// NonRoot is the user distroless's nonroot images run as, and the final stages' USER.
const NonRoot = 65532

// BaseLayer stands for gcr.io/distroless/static:nonroot: the passwd and group entries of root,
// nobody and nonroot, a world-writable /tmp with the sticky bit, and this machine's CA
// certificates.
func BaseLayer() (v1.Layer, error) {
	certs, err := os.ReadFile("/etc/ssl/certs/ca-certificates.crt")
	if err != nil {
		return nil, fmt.Errorf("the base layer's CA certificates (Debian's ca-certificates): %w", err)
	}
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", NonRoot, NonRoot)
	group := fmt.Sprintf("root:x:0:\nnobody:x:65534:\nnonroot:x:%d:\n", NonRoot)
	return Layer([]File{
		{Path: "/etc/passwd", Data: []byte(passwd), Mode: 0o644},
		{Path: "/etc/group", Data: []byte(group), Mode: 0o644},
		{Path: "/etc/ssl/certs/ca-certificates.crt", Data: certs, Mode: 0o644},
		{Path: "/tmp", Mode: int64(fs.ModeDir) | 0o1777},
		{Path: "/home/nonroot", Mode: int64(fs.ModeDir) | 0o700, UID: NonRoot},
	})
}

// Write writes img to file as a tarball tagged ref, as `docker save` writes one.
func Write(img v1.Image, ref, file string) error {
	tag, err := name.NewTag(ref)
	if err != nil {
		return fmt.Errorf("image reference %q: %w", ref, err)
	}
	if err := tarball.WriteToFile(file, tag, img); err != nil {
		return fmt.Errorf("write image %s to %s: %w", ref, file, err)
	}
	return nil
}

// FromHost is the files of this machine's programs (absolute paths) with every shared library
// they load, as ldd lists them, and the dynamic loader: what an image needs to run a program of
// Debian's, such as redis-server, without the rest of the system. Links are followed: each file
// is stored under the path the program or ldd names.
func FromHost(programs ...string) ([]File, error) {
	seen := map[string]bool{}
	var files []File
	add := func(p string) error {
		if seen[p] {
			return nil
		}
		seen[p] = true
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		files = append(files, File{Path: p, Data: data, Mode: 0o755})
		return nil
	}
	for _, prog := range programs {
		if err := add(prog); err != nil {
			return nil, err
		}
		out, err := exec.Command("ldd", prog).Output()
		if err != nil {
			return nil, fmt.Errorf("ldd %s: %w", prog, err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			// "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
			fields := strings.Fields(line)
			for _, f := range fields {
				if strings.HasPrefix(f, "/") {
					if err := add(f); err != nil {
						return nil, err
					}
					break
				}
			}
		}
	}
	return files, nil
}

// ReadFile reads the file at path (no leading slash needed) of img's filesystem, its layers
// applied in order.
func ReadFile(img v1.Image, path string) ([]byte, error) {
	fsys := mutate.Extract(img)
	defer func() { _ = fsys.Close() }()
	tr := tar.NewReader(fsys)
	want := strings.TrimPrefix(path, "/")
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("no /%s in the image", want)
		}
		if err != nil {
			return nil, err
		}
		if strings.TrimPrefix(h.Name, "/") == want {
			return io.ReadAll(tr)
		}
	}
}
