package enforcer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/enforcer/policy"
	"github.com/sluice-dev/sluice/enforcer/schema"
)

// Load compiles one or more RateLimitPolicy documents, exactly as users apply them with kubectl:
// the file a user writes for standalone mode, and the one the controller renders into the
// enforcer's ConfigMap, read from the mount or through the API server, all go through here.
// Each is held to what the API server would hold it to (see Validate); unknown fields are
// errors, so a typo is never silently dropped.
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
		p, err := decode(raw)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		c, err := policy.Compile(p)
		if err != nil {
			return nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, err)
		}
		if p.Spec.Storage != nil {
			return nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, field.Forbidden(field.NewPath("spec", "storage"), storageFromFlags))
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

// Validate decodes one RateLimitPolicy document and judges it as the API server would on
// create, with the admission webhook served: the CRD's own schema and CEL rules (package
// schema), unknown fields refused as kubectl's strict field validation does, then the semantic
// validation the webhook and the controller share (policy.Validate). A document without a
// namespace is in "default", as kubectl would put it with no namespace configured.
func Validate(raw []byte) (*v1alpha1.RateLimitPolicy, error) {
	p, err := decode(raw)
	if err != nil {
		return nil, err
	}
	if errs := policy.Validate(p); len(errs) > 0 {
		return nil, fmt.Errorf("policy %s/%s: %w", p.Namespace, p.Name, errs.ToAggregate())
	}
	return p, nil
}

// decode is Validate less the semantic validation, which Load gets from policy.Compile.
func decode(raw []byte) (*v1alpha1.RateLimitPolicy, error) {
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, err
	}
	var obj map[string]any
	if err := utiljson.Unmarshal(js, &obj); err != nil { // integers as int64, as the API server reads them
		return nil, err
	}
	if obj == nil {
		return nil, errors.New("not an object")
	}
	if obj["apiVersion"] != v1alpha1.GroupVersion.String() || obj["kind"] != "RateLimitPolicy" {
		return nil, fmt.Errorf("apiVersion %v kind %v, want %s RateLimitPolicy", obj["apiVersion"], obj["kind"], v1alpha1.GroupVersion)
	}
	if meta, ok := obj["metadata"].(map[string]any); ok && meta["namespace"] == nil {
		meta["namespace"] = "default"
	}
	name := func() string {
		meta, _ := obj["metadata"].(map[string]any)
		return fmt.Sprintf("%v/%v", meta["namespace"], meta["name"])
	}()
	if errs := schema.Validate(context.Background(), obj); len(errs) > 0 {
		return nil, fmt.Errorf("policy %s: %w", name, errs.ToAggregate())
	}
	defaulted, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var p v1alpha1.RateLimitPolicy
	if err := yaml.UnmarshalStrict(defaulted, &p); err != nil {
		return nil, fmt.Errorf("policy %s: %w", name, err)
	}
	return &p, nil
}

// storageFromFlags says why a file may not choose the store: one enforcer has one store for all
// the policies of its file, and the controller passes it as flags too.
const storageFromFlags = "an enforcer takes its store from flags, not from the policy file: remove spec.storage and " +
	"start it with --redis-url, --redis-cluster or --redis-sentinel for Redis, or with none of them for the memory store"

func isOnlyComments(raw []byte) bool {
	for _, line := range bytes.Split(raw, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' && !bytes.Equal(line, []byte("---")) {
			return false
		}
	}
	return true
}
