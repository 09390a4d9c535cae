package enforcer

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/policy"
)

// LoadFile reads and compiles the RateLimitPolicy documents of a file: the file a user writes for
// standalone mode, or the one the controller renders into the enforcer's ConfigMap. Both go
// through here.
func LoadFile(path string) ([]*policy.Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Load(data)
}

// Load compiles one or more RateLimitPolicy documents, exactly as users apply them with kubectl.
// Unknown fields are errors, so a typo is never silently dropped.
func Load(data []byte) ([]*policy.Policy, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out []*policy.Policy
	ids := map[string]bool{}
	for doc := 1; ; doc++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 || isOnlyComments(raw) {
			continue
		}
		var p v1alpha1.RateLimitPolicy
		if err := yaml.UnmarshalStrict(raw, &p); err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if p.APIVersion != v1alpha1.GroupVersion.String() || p.Kind != "RateLimitPolicy" {
			return nil, fmt.Errorf("document %d: apiVersion %q kind %q, want %s RateLimitPolicy", doc, p.APIVersion, p.Kind, v1alpha1.GroupVersion)
		}
		if p.Namespace == "" {
			p.Namespace = "default"
		}
		c, err := policy.Compile(&p)
		if err != nil {
			return nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, err)
		}
		if ids[c.ID] {
			return nil, fmt.Errorf("policy %s appears twice", c.ID)
		}
		ids[c.ID] = true
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no RateLimitPolicy found")
	}
	return out, nil
}

func isOnlyComments(raw []byte) bool {
	for _, line := range bytes.Split(raw, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' && !bytes.Equal(line, []byte("---")) {
			return false
		}
	}
	return true
}
